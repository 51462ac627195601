"""docker/launch.sh in its CPU mode on this machine, for real, with the demo's trainer: one node,
two "nodes" on one machine, and a worker killed mid-run that torchrun restarts from the last
checkpoint. tests/run.sh runs these on Python 3.11; the image stage runs launch.sh on 3.12 in
containers, with Megatron-LM's pretrain_gpt.py."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from del_megatron.tools.cli import main
from tests.distributed import free_port

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "docker" / "launch.sh"
STEPS = 60
TRAIN = f"--steps {STEPS} --micro-batch 8 --seq-len 32 --hidden 64 --heads 4 --eval-problems 4"
TRAIN = (TRAIN + " --save-interval 20 --warmup 10 --lr 0.005 --no-progress --resume").split()


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("launch") / "data"
    assert main(["prepare", "--out", str(out), "--num-docs", "2000", "--num-eval", "8"]) == 0
    return out


def launch(out_dir, data_dir, log_name, **env):
    full_env = {
        **os.environ,
        "DEL_CPU": "1",
        "PYTHON": sys.executable,
        "PYTHONWARNINGS": "ignore",
        **{k: str(v) for k, v in env.items()},
    }
    full_env.setdefault("MASTER_PORT", str(free_port()))
    # One marker per launch: the two "nodes" share MASTER_PORT, and cleaning up after node 0 must
    # not SIGKILL node 1 while it is still tearing down.
    full_env["DEL_TEST_LAUNCH"] = uuid.uuid4().hex
    cmd = [
        "bash",
        str(LAUNCH),
        "-m",
        "del_megatron.tools.cli",
        "train",
        "--data-dir",
        str(data_dir),
        "--out-dir",
        str(out_dir),
        "--loss",
        "del",
        *TRAIN,
    ]
    log = open(Path(out_dir).parent / log_name, "w+")  # a file: an unread pipe would fill up
    proc = subprocess.Popen(
        cmd,
        env=full_env,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    proc.log = log
    proc.job_marker = f"DEL_TEST_LAUNCH={full_env['DEL_TEST_LAUNCH']}".encode()
    return proc


def _kill_leftovers(marker: bytes) -> None:
    """SIGKILL what the job left running: torchrun starts each worker in a session of its own,
    and a killed worker's children (a spawn pool it had started) outlive it, orphaned."""
    for proc_dir in Path("/proc").iterdir():
        if not proc_dir.name.isdigit() or int(proc_dir.name) == os.getpid():
            continue
        try:
            environ = (proc_dir / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if marker in environ:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(proc_dir.name), signal.SIGKILL)


def finish(proc, timeout=300):
    try:
        proc.wait(timeout=timeout)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        _kill_leftovers(proc.job_marker)
    proc.log.seek(0)
    output = proc.log.read()
    assert proc.returncode == 0, output[-4000:]
    return output


def losses(out_dir):
    metrics = json.loads((Path(out_dir) / "metrics.json").read_text())
    assert metrics["finished"]
    return [h["loss"] for h in metrics["history"]]


@pytest.fixture(scope="module")
def undisturbed(data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "one_node"
    finish(launch(out, data_dir, "one_node.log", NPROC_PER_NODE=2))
    return losses(out)


def test_one_node_two_processes(undisturbed):
    assert len(undisturbed) == STEPS and undisturbed[-1] < undisturbed[0]


def test_two_nodes_on_one_machine(data_dir, undisturbed, tmp_path):
    port = free_port()
    nodes = [
        launch(
            tmp_path / "out",
            data_dir,
            f"node{rank}.log",
            NNODES=2,
            NODE_RANK=rank,
            NPROC_PER_NODE=1,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
        )
        for rank in (0, 1)
    ]
    for node in nodes:
        finish(node)
    assert losses(tmp_path / "out") == pytest.approx(undisturbed, rel=1e-5)


def _worker_pids(out_dir):
    pids = []
    for proc_dir in Path("/proc").iterdir():
        if not proc_dir.name.isdigit():
            continue
        try:
            argv = (proc_dir / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if str(out_dir) in argv and "-u" in argv and "torch.distributed.run" not in argv:
            pids.append(int(proc_dir.name))
    return pids


def test_killed_worker_restarts_from_checkpoint_and_ends_the_same(data_dir, undisturbed, tmp_path):
    out = tmp_path / "out"
    proc = launch(out, data_dir, "killed.log", NPROC_PER_NODE=2, MAX_RESTARTS=2)
    latest = out / "checkpoints" / "latest"
    deadline = time.time() + 240
    while not latest.exists():
        assert proc.poll() is None and time.time() < deadline, "no checkpoint appeared"
        time.sleep(0.05)
    victims = _worker_pids(out)
    assert len(victims) == 2, victims
    os.kill(victims[1], signal.SIGKILL)
    output = finish(proc)
    assert "exitcode: -9" in output, output[-2000:]  # torchrun saw the kill, then restarted
    assert losses(out) == pytest.approx(undisturbed, rel=1e-5)

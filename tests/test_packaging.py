"""The package's metadata (pyproject.toml): one version, the console script, the Python and torch
bounds CI runs, the extras, the data file, the license. Static: nothing is built or downloaded
here; the wheel stage (tests/wheel/run.sh) builds and installs the wheel."""

import ast
import importlib.metadata
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

import del_megatron

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]


def _requirement(requirements, name):
    found = [r for r in map(Requirement, requirements) if r.name == name]
    assert len(found) == 1, f"{name}: {requirements}"
    return found[0]


def _ci_pythons():
    """The Python versions of CI's pinned environments (examples/setup_env.sh)."""
    versions = re.findall(
        r"^\s*py3\d+\) version=(3\.\d+) ", (ROOT / "examples/setup_env.sh").read_text(), re.M
    )
    assert versions, "no Python versions found in examples/setup_env.sh"
    return sorted(set(versions), key=Version)


def test_build_system_is_setuptools_pep517():
    build = PYPROJECT["build-system"]
    assert build["build-backend"] == "setuptools.build_meta"
    setuptools = _requirement(build["requires"], "setuptools")
    # license as an SPDX expression with license-files needs setuptools >= 77 (PEP 639)
    assert Version("77.0.3") in setuptools.specifier and Version("76") not in setuptools.specifier


def test_setup_py_is_a_shim_without_metadata():
    tree = ast.parse((ROOT / "setup.py").read_text())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    assert [ast.unparse(c) for c in calls] == ["setup()"], "metadata belongs in pyproject.toml"


def test_version_has_one_source():
    assert PROJECT["name"] == "del-megatron"
    assert "version" not in PROJECT and PROJECT["dynamic"] == ["version"]
    dynamic = PYPROJECT["tool"]["setuptools"]["dynamic"]
    assert dynamic["version"] == {"attr": "del_megatron.__version__"}
    # a plain string literal, which setuptools reads without importing the package (and torch)
    tree = ast.parse((ROOT / "del_megatron/__init__.py").read_text())
    literals = [
        node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and [ast.unparse(t) for t in node.targets] == ["__version__"]
        and isinstance(node.value, ast.Constant)
    ]
    assert literals == [del_megatron.__version__]
    assert Version(del_megatron.__version__)  # a valid version


def test_setuptools_reads_the_version_without_importing_the_package():
    pytest.importorskip("setuptools")
    code = (
        "import sys; from setuptools.config.expand import read_attr; "
        f"v = read_attr('del_megatron.__version__', root_dir={str(ROOT)!r}); "
        "assert 'del_megatron' not in sys.modules and 'torch' not in sys.modules, 'imported'; "
        "print(v)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == del_megatron.__version__


def test_citation_repeats_the_version():
    cff = (ROOT / "CITATION.cff").read_text()
    versions = re.findall(r"^version:\s*\"?([^\"\s]+)\"?\s*$", cff, re.M)
    assert versions == [del_megatron.__version__], "CITATION.cff's version: edit it with __init__'s"


def test_console_script():
    assert PROJECT["scripts"] == {"del-megatron": "del_megatron.tools.cli:main"}
    import del_megatron.tools.cli

    assert callable(del_megatron.tools.cli.main)


def test_requires_python_is_what_ci_runs():
    pythons = _ci_pythons()
    assert pythons == ["3.11", "3.12"], pythons
    spec = SpecifierSet(PROJECT["requires-python"])
    for python in pythons:
        assert Version(python) in spec, python
    lowest, highest = Version(pythons[0]), Version(pythons[-1])
    below = Version(f"{lowest.major}.{lowest.minor - 1}")
    above = Version(f"{highest.major}.{highest.minor + 1}")
    assert below not in spec and above not in spec, f"{spec} admits Pythons CI does not run"
    assert Version(f"{sys.version_info.major}.{sys.version_info.minor}") in spec
    classified = [
        c.rsplit(" :: ", 1)[1]
        for c in PROJECT["classifiers"]
        if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)
    ]
    assert classified == pythons


def test_torch_floor_is_megatron_cores_and_torch_stays_unpinned_above():
    torch = _requirement(PROJECT["dependencies"], "torch")
    assert [s.operator for s in torch.specifier] == [">="], f"{torch}: no upper bound or pin"
    floor = Version(next(iter(torch.specifier)).version)
    # megatron-core's own floor (0.16.1 and 0.19.2: torch>=2.6.0): not below it
    core_torch = _requirement(
        [r for r in importlib.metadata.requires("megatron-core") if "extra ==" not in r], "torch"
    )
    core_floor = max(Version(s.version) for s in core_torch.specifier if s.operator == ">=")
    assert floor >= core_floor, f"torch>={floor} is below megatron-core's torch>={core_floor}"
    assert importlib.metadata.version("torch").split("+")[0] in torch.specifier
    core = _requirement(PROJECT["optional-dependencies"]["megatron"], "megatron-core")
    assert importlib.metadata.version("megatron-core") in core.specifier


def test_extras():
    extras = PROJECT["optional-dependencies"]
    assert sorted(extras) == ["demo", "megatron", "test"]
    assert not any(r.startswith("transformer") for reqs in extras.values() for r in reqs)


def test_package_data_and_packages():
    tool = PYPROJECT["tool"]["setuptools"]
    assert tool["packages"]["find"]["include"] == ["del_megatron", "del_megatron.*"]
    data = tool["package-data"]
    assert data == {"del_megatron.cpu": ["site/sitecustomize.py"]}
    for package, files in data.items():
        for name in files:
            assert (ROOT / package.replace(".", "/") / name).is_file(), name


def test_license_and_urls():
    assert PROJECT["license"] == "Apache-2.0"
    assert PROJECT["license-files"] == ["LICENSE"]
    assert "Apache License" in (ROOT / "LICENSE").read_text()[:200]
    # with a license expression, setuptools refuses license classifiers (PEP 639)
    assert not [c for c in PROJECT["classifiers"] if c.startswith("License ::")]
    assert (ROOT / PROJECT["readme"]).is_file()
    urls = PROJECT["urls"]
    assert urls == {
        "Paper": "https://arxiv.org/abs/2605.20369",
        "Reference implementation": "https://github.com/PolyU-VCLab/DEL",
    }
    cff = (ROOT / "CITATION.cff").read_text()
    assert all(url in cff for url in urls.values()), "the URLs CITATION.cff gives"


def test_docker_image_build_context_has_what_the_build_reads():
    """docker/Dockerfile runs `pip install --no-deps /opt/del-megatron` on the files it copies:
    those must include every file the build reads (pyproject.toml above all: without it the shim
    setup.py has no metadata), and .dockerignore must let them into the context."""
    needed = {"setup.py", "pyproject.toml", PROJECT["readme"], *PROJECT["license-files"]}
    copied = set()
    for line in (ROOT / "docker/Dockerfile").read_text().splitlines():
        words = line.split()
        if words[:1] == ["COPY"] and words[-1].startswith("/opt/del-megatron"):
            copied.update(w for w in words[1:-1] if not w.startswith("--"))
    assert not needed - copied, f"docker/Dockerfile does not COPY {sorted(needed - copied)}"
    allowed = {
        line[1:].strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    }
    assert not needed - allowed, f".dockerignore keeps out {sorted(needed - allowed)}"


def test_shellcheck_passes_on_the_wheel_stage():
    shellcheck = shutil.which("shellcheck")
    assert shellcheck, "shellcheck missing: tests/run.sh installs Debian's shellcheck"
    out = subprocess.run(
        [shellcheck, "-x", "tests/wheel/run.sh"], capture_output=True, text=True, cwd=ROOT
    )
    assert out.returncode == 0, out.stdout + out.stderr

#!/usr/bin/env bash
# Creates (or refreshes) a pinned CPU environment at the repository root.
#   bash examples/setup_env.sh          .venv            Python 3.11, torch 2.13.0 (CPU build),
#                                                        megatron-core 0.16.1
#   bash examples/setup_env.sh py312    .venv312         Python 3.12, torch 2.14.1 (CUDA build, runs
#                                                        on CPU), megatron-core 0.19.2, transformers
#                                                        5.24.0 (Megatron-LM's HuggingFaceTokenizer)
#   bash examples/setup_env.sh bridge   .venv312-bridge  .venv312 plus megatron-bridge 0.6.2,
#                                                        nemo_toolkit 2.7.0 (and what they import)
#                                                        and nvidia-resiliency-ext 0.7.0
#   bash examples/setup_env.sh automodel .venv-automodel .venv plus nemo-automodel 0.7.0 (its
#                                                        transformers 5.18.0, triton 3.8.0)
# Pins: tests/requirements-cpu.txt, tests/requirements-py312.txt, tests/requirements-bridge.txt,
# tests/requirements-nvrx.txt, tests/requirements-automodel.txt.
# The bridge environment is a layer over .venv312 (its site-packages are on the path through a
# .pth file), so that Megatron-LM runs in .venv312 do not import what Bridge and NeMo bring:
# Megatron-LM imports nvidia-modelopt whenever it is installed (11 s in every process). The layer
# has its own transformers 5.12.1 and tokenizers 0.22.2 (Bridge's pins), which shadow .venv312's.
# The automodel environment is the same kind of layer over .venv (torch 2.13.0 CPU).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
case "${1:-py311}" in
  py311) version=3.11 venv=.venv requirements=tests/requirements-cpu.txt ;;
  py312) version=3.12 venv=.venv312 requirements=tests/requirements-py312.txt ;;
  bridge) bash "$0" py312
    version=3.12 venv=.venv312-bridge requirements=tests/requirements-bridge.txt
    nvrx=tests/requirements-nvrx.txt ;;
  automodel) bash "$0" py311
    version=3.11 venv=.venv-automodel requirements=tests/requirements-automodel.txt ;;
  *) echo "usage: $0 [py311|py312|bridge|automodel]" >&2; exit 2 ;;
esac

find_python() {  # python$1 on PATH, else a pyenv install of it
  local candidate
  for candidate in "python$1" "$(pyenv root 2>/dev/null)"/versions/"$1".*/bin/"python$1" \
      /root/.pyenv/versions/"$1".*/bin/"python$1" /usr/local/bin/"python$1" /usr/bin/"python$1"; do
    if "$candidate" -c 'import venv' >/dev/null 2>&1; then
      command -v "$candidate" || echo "$candidate"
      return
    fi
  done
  echo "Python $1 not found (looked on PATH and in pyenv's versions): install it, or set PYTHON" >&2
  exit 1
}

if [ ! -x "$venv/bin/python" ]; then
  "${PYTHON:-$(find_python "$version")}" -m venv "$venv"
fi
stamp=$venv/.del-megatron-installed
nodeps=tests/requirements-nodeps.txt
if [ ! -f "$stamp" ] || [ "$requirements" -nt "$stamp" ] || [ setup.py -nt "$stamp" ] || [ pyproject.toml -nt "$stamp" ] \
    || [ "${nvrx:-$requirements}" -nt "$stamp" ] || [ "$nodeps" -nt "$stamp" ]; then
  pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
  if [ "$venv" = .venv-automodel ]; then
    base=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    own=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "import site; site.addsitedir('$base')" >"$own/del_megatron_base_env.pth"
    "${pip[@]}" -r "$requirements"  # beside .venv's torch: nothing pulls another build
  elif [ "$venv" = .venv312-bridge ]; then
    base=$(.venv312/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    own=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "import site; site.addsitedir('$base')" >"$own/del_megatron_base_env.pth"
    # Megatron-Bridge and NeMo, pinned with what they import on CPU; their own requirements
    # (Transformer Engine, CUDA-only packages) cannot install here.
    "${pip[@]}" --no-deps -r "$requirements"
    # NVRx 0.7.0 exists only as a manylinux_2_39 wheel (glibc 2.39); this machine may have an
    # older glibc. Only its CUPTI module is compiled, imported only for straggler detection
    # (tests/requirements-nvrx.txt): pip installs the published wheel, hash-checked, for the
    # platform named here, into this environment's site-packages.
    "${pip[@]}" --no-deps --only-binary=:all: --platform manylinux_2_39_x86_64 \
      --python-version 3.12 --implementation cp --abi cp312 --target "$own" --upgrade \
      --require-hashes -r "$nvrx"
  else
    # torch first and exactly pinned, so nothing after it can pull another build.
    "${pip[@]}" "$(grep -E '^torch==' "$requirements")"
    "${pip[@]}" -r "$requirements"
    "${pip[@]}" --no-deps -r "$nodeps"
    "${pip[@]}" --no-deps -e .
  fi
  touch "$stamp"
fi
# The test suite lints the shell scripts with Debian's shellcheck.
if ! command -v shellcheck >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    # the two set-ups of a CI run can reach this at the same time: wait for the other's apt
    apt=(apt-get -qq -o DPkg::Lock::Timeout=600)
    "${apt[@]}" install -y shellcheck >/dev/null 2>&1 \
      || { "${apt[@]}" update >/dev/null && "${apt[@]}" install -y shellcheck >/dev/null; }
  else
    echo "note: shellcheck is not installed; the shell-lint test will fail" >&2
  fi
fi

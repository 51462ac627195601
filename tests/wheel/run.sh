#!/usr/bin/env bash
# The wheel stage: the package as users install it, not as the tests import it (the pinned
# environments hold an editable install of this checkout).
#   1. builds the wheel with pip (PEP 517, build isolation: setuptools from the index, as
#      `pip install ./del-megatron` does) from a copy of the checkout's files (git's tracked and
#      untracked-but-not-ignored ones: what a clone holds; no build/ left in the checkout);
#   2. installs it, --no-deps and --no-index, into a fresh virtual environment (Python 3.11, no pip
#      of its own: .venv's pip installs into it);
#   3. then puts .venv's site-packages behind it with a .pth file (a plain path: .venv's own .pth
#      files, among them the editable install's finder, are not run), so that the pinned torch and
#      megatron-core serve it without a second download, and the checkout is not on its path;
#   4. from a folder outside the checkout: `del-megatron check` on a SentencePiece model trained
#      here (tests/wheel/sentencepiece_model.py), and tests/wheel/smoke.py (the package, its
#      metadata and its data file come from the fresh environment; a DEL loss against the fp64
#      reference, and its gradient).
# Usage: bash tests/wheel/run.sh (or bash tests/run.sh wheel); WHEEL_TEST_KEEP=1 keeps its
# temporary folder.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
bash examples/setup_env.sh py311
python=$root/.venv/bin/python

work=$(mktemp -d "${TMPDIR:-/tmp}/del-megatron-wheel.XXXXXX")
cleanup() {
  if [ "${WHEEL_TEST_KEEP:-0}" = 1 ]; then echo "kept $work"; else rm -rf "$work"; fi
}
trap cleanup EXIT
step() { echo "--- $* (at $SECONDS s)"; }

step "build (pip wheel --no-deps, from a copy of the checkout's files)"
mkdir "$work/src"
git ls-files -z --cached --others --exclude-standard \
  | while IFS= read -r -d '' file; do [ ! -e "$file" ] || printf '%s\0' "$file"; done \
  | tar --null --files-from=- -cf - | tar -xf - -C "$work/src"
"$python" -m pip wheel --no-deps --wheel-dir "$work/dist" "$work/src"
wheels=("$work"/dist/del_megatron-*-py3-none-any.whl)
if [ "${#wheels[@]}" != 1 ] || [ ! -f "${wheels[0]}" ]; then
  echo "expected one wheel in $work/dist: $(ls "$work/dist")" >&2
  exit 1
fi

step "install into a fresh environment (pip install --no-deps --no-index)"
venv=$work/venv
"$python" -m venv --without-pip "$venv"
"$python" -m pip --python "$venv/bin/python" install --no-deps --no-index "${wheels[0]}"
libs='import sysconfig; p = sysconfig.get_paths(); print(p["purelib"]); print(p["platlib"])'
pinned=$("$python" -c "$libs" | sort -u)
own=$("$venv/bin/python" -I -c "$libs" | head -n 1)
echo "$pinned" >"$own/del_megatron_pinned_env.pth"
echo "torch and megatron-core from $(echo "$pinned" | tr '\n' ' ')(del_megatron_pinned_env.pth)"

step "del-megatron check, from $work"
cd "$work"
unset PYTHONPATH
"$venv/bin/python" -I "$root/tests/wheel/sentencepiece_model.py" "$work/split.model"
"$venv/bin/del-megatron" check --tokenizer "$work/split.model" | tee "$work/check.log"
for want in "numbers tokenize one digit per token" "--numerical-loss del --del-alpha 0.1 "; do
  grep -q -F -- "$want" "$work/check.log" || { echo "check printed no \"$want\"" >&2; exit 1; }
done

step "the package, its metadata and a DEL loss (tests/wheel/smoke.py)"
"$venv/bin/python" -I "$root/tests/wheel/smoke.py" "$root" "$venv"
step "wheel check passed"

"""The files of torch, numpy and everything torch requires on this platform, as installed in the
running environment, put into another site-packages: the stand-in base gets them
(tests/image/run.sh runs this with the py312 test environment's Python, which has packaging).

    python torch_files.py DEST    # DEST: the stand-in's site-packages folder

Each file is hard-linked where DEST is on the same file system (a tar-to-tar copy took 84 s of
the image stage) and copied where it is not. Nothing writes to these files before the root file
system is imported and removed, so the links never change the environment's copy.

Left out, as the stand-in runs on a CPU: the CUDA libraries of the nvidia packages that no
library links (DT_NEEDED, read with readelf), which torch and cuDNN open only on a GPU (cuDNN's
engines, cuSOLVER, ...: 1.2 GB of torch 2.14.1's), and triton's CUDA toolchain
(triton/backends/nvidia/bin and lib: 0.36 GB), which it runs only to compile GPU kernels. The
packages' metadata stays whole, so pip sees them installed.
"""

import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

from packaging.requirements import Requirement


def closure(names):
    """{normalized name: distribution} of `names` and, recursively, what they require here
    (extras included: torch requires cuda-toolkit[cudart, ...])."""
    seen, todo = {}, [(name, ()) for name in names]
    while todo:
        name, extras = todo.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        try:
            dist = seen.get(key) or distribution(key)
        except PackageNotFoundError:
            continue  # an optional requirement not installed here
        done = seen.setdefault(f"{key}[]", set())
        wanted = {""} | set(extras)
        if key in seen and wanted <= done:
            continue
        seen[key] = dist
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or any(
                req.marker.evaluate({"extra": extra}) for extra in wanted - done
            ):
                todo.append((req.name, tuple(req.extras)))
        done |= wanted
    return {key: dist for key, dist in seen.items() if not key.endswith("[]")}


def link_or_copy(source: Path, target: Path) -> str:
    """Puts `source` at `target`; says how: "linked", "copied (<why not linked>)" or "symlink"."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.is_symlink() or target.exists():  # a rerun over a partial one
        target.unlink()
    if source.is_symlink():
        os.symlink(os.readlink(source), target)
        return "symlink"
    try:
        os.link(source, target)
        return "linked"
    except OSError as error:  # another file system (or one without hard links)
        shutil.copy2(source, target)
        return f"copied ({os.strerror(error.errno)})"


def linked_names(path: Path) -> list:
    """The sonames a shared library or extension module links (its DT_NEEDED entries)."""
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", out)


def gpu_only(files: list) -> set:
    """Of `files` (absolute Paths), those only a GPU run opens: the nvidia/*/lib libraries
    outside the DT_NEEDED closure of every other library, and triton's CUDA toolchain."""
    cuda_libs = [f for f in files if "nvidia" in f.parts and ".so" in f.name]
    by_name = {}
    for f in cuda_libs:
        by_name.setdefault(f.name, []).append(f)
    todo = [n for f in files if ".so" in f.name and f not in cuda_libs for n in linked_names(f)]
    linked = set()
    while todo:
        name = todo.pop()
        if name not in linked:
            linked.add(name)
            todo += [n for f in by_name.get(name, []) for n in linked_names(f)]
    unlinked = {f for f in cuda_libs if f.name not in linked}
    toolchain = {
        f
        for f in files
        if "/triton/backends/nvidia/bin/" in f.as_posix()
        or "/triton/backends/nvidia/lib/" in f.as_posix()
    }
    return unlinked | toolchain


def main(argv: list) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    dest = Path(argv[0])
    files = {}  # absolute source: its path relative to site-packages
    for dist in closure(["torch", "numpy"]).values():
        for path in dist.files or []:
            if ".." not in path.parts:  # console scripts live outside site-packages
                files[Path(dist.locate_file(path))] = path
    regular = [f for f in files if f.is_file() and not f.is_symlink()]
    left_out = gpu_only(regular)
    how = Counter(
        link_or_copy(source, dest / path)
        for source, path in files.items()
        if source not in left_out
    )
    size = sum(f.stat().st_size for f in left_out)
    print(", ".join(f"{n} {what}" for what, n in sorted(how.items())), end="; ")
    print(f"left out {len(left_out)} GPU-only files ({size / 2**30:.2f} GiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

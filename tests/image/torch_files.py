"""The files of torch, numpy and everything torch requires on this platform, as installed in the
running environment, put into another site-packages: the stand-in base gets them
(tests/image/run.sh runs this with the py312 test environment's Python, which has packaging).

    python torch_files.py DEST    # DEST: the stand-in's site-packages folder

Each file is hard-linked where DEST is on the same file system (5.5 GB: a tar-to-tar copy took
84 s of the image stage) and copied where it is not. Nothing writes to these files before the
root file system is imported and removed, so the links never change the environment's copy.
"""

import os
import re
import shutil
import sys
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


def link_or_copy(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    if source.is_symlink():
        os.symlink(os.readlink(source), target)
        return
    try:
        os.link(source, target)
    except OSError:  # another file system (or one without hard links)
        shutil.copy2(source, target)


def main(argv: list) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    dest = Path(argv[0])
    for dist in closure(["torch", "numpy"]).values():
        for path in dist.files or []:
            if ".." not in path.parts:  # console scripts live outside site-packages
                link_or_copy(Path(dist.locate_file(path)), dest / path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

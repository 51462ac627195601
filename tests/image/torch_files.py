"""Prints the files (relative to site-packages) of torch, numpy and everything torch requires
on this platform, as installed in the running environment: the stand-in base gets them
(tests/image/run.sh runs this with the py312 test environment's Python, which has packaging)."""

import re
import sys
from importlib.metadata import PackageNotFoundError, distribution

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


def main() -> int:
    for dist in closure(["torch", "numpy"]).values():
        for path in dist.files or []:
            if ".." not in path.parts:  # console scripts live outside site-packages
                print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

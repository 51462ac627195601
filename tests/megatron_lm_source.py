"""Where the Megatron-LM sources of the e2e and image stages come from (docs/testing.md).

For a release tag, the first of these that has it:

1. MEGATRON_LM_DIR: a Megatron-LM checkout, used as the release asked for;
2. MEGATRON_LM_ARCHIVES: folders (separated by os.pathsep) of release snapshots `<tag>.tar.gz`,
   each unpacking to one top folder (GitHub's `Megatron-LM-<tag>/` or `megatron-lm-<tag>/`);
3. a clone made before, in MEGATRON_LM_CACHE [~/.cache/del-megatron/megatron-lm]/<tag>;
4. a shallow clone of the tag from MEGATRON_LM_REPO [upstream GitHub], when the network allows
   (MEGATRON_LM_REPO="" never clones).

When none has it, SourceUnavailable says so in one line, with what to set. Standard library only:
tests/image/run.sh runs it with the host's python3.

    python3 tests/megatron_lm_source.py check TAG...      where each tag comes from (exit 3: none)
    python3 tests/megatron_lm_source.py tree TAG DEST     unpack/copy it under DEST, print the path
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import List, Mapping, Optional, Sequence

UPSTREAM = "https://github.com/NVIDIA/Megatron-LM.git"
PROBE_TIMEOUT_S = 30
CLONE_TIMEOUT_S = 600
UNAVAILABLE_EXIT = 3


class SourceUnavailable(RuntimeError):
    """No source has the release; the message is one line and names what to set."""


@dataclass(frozen=True)
class Source:
    """Where one tag's sources are: kind is "checkout", "archive", "cache" or "clone"; location
    is a path (a URL for "clone")."""

    tag: str
    kind: str
    location: str

    def __str__(self) -> str:
        return f"Megatron-LM {self.tag}: {self.kind} {self.location}"


def archive_folders(env: Mapping[str, str]) -> List[Path]:
    """The snapshot folders MEGATRON_LM_ARCHIVES names (E2E_MEGATRON_LM_ARCHIVES, its older name,
    too), in order."""
    folders = []
    for name in ("MEGATRON_LM_ARCHIVES", "E2E_MEGATRON_LM_ARCHIVES"):
        folders += [Path(p) for p in env.get(name, "").split(os.pathsep) if p]
    return folders


def cache_folder(env: Mapping[str, str]) -> Path:
    if env.get("MEGATRON_LM_CACHE"):
        return Path(env["MEGATRON_LM_CACHE"])
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "del-megatron" / "megatron-lm"


def _repo(env: Mapping[str, str]) -> str:
    return env.get("MEGATRON_LM_REPO", UPSTREAM)


def _remote_has_tag(repo: str, tag: str) -> bool:
    """Whether `repo` answers within PROBE_TIMEOUT_S and has `tag` (no prompt for credentials)."""
    if not repo or shutil.which("git") is None:
        return False
    probe = ["git", "ls-remote", "--exit-code", "--tags", repo, f"refs/tags/{tag}"]
    try:
        done = subprocess.run(
            probe,
            env={**os.environ, "GIT_TERMINAL_PROMPT": "0"},
            capture_output=True,
            timeout=PROBE_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0


def unavailable_message(tags: Sequence[str], env: Mapping[str, str]) -> str:
    repo = _repo(env)
    clone = (
        f"let git reach {repo} (a shallow clone is cached in {cache_folder(env)})"
        if repo
        else "set MEGATRON_LM_REPO to a git URL that has the tag (it is empty: no clone)"
    )
    return (
        f"Megatron-LM {' '.join(tags)}: no sources found. Set MEGATRON_LM_ARCHIVES to a folder "
        "of <tag>.tar.gz release snapshots, or MEGATRON_LM_DIR to a checkout of the tag, or "
        + clone
    )


def find(tag: str, env: Optional[Mapping[str, str]] = None, network: bool = True) -> Source:
    """Where `tag`'s sources are (module docstring's order); SourceUnavailable if nowhere."""
    env = os.environ if env is None else env
    if env.get("MEGATRON_LM_DIR"):
        checkout = Path(env["MEGATRON_LM_DIR"])
        if not (checkout / "pretrain_gpt.py").is_file():
            raise SourceUnavailable(f"MEGATRON_LM_DIR={checkout} has no pretrain_gpt.py")
        return Source(tag, "checkout", str(checkout))
    for folder in archive_folders(env):
        archive = folder / f"{tag}.tar.gz"
        if archive.is_file():
            return Source(tag, "archive", str(archive))
    cached = cache_folder(env) / tag
    if (cached / "pretrain_gpt.py").is_file():
        return Source(tag, "cache", str(cached))
    if network and _remote_has_tag(_repo(env), tag):
        return Source(tag, "clone", _repo(env))
    raise SourceUnavailable(unavailable_message([tag], env))


def find_all(tags: Sequence[str], env: Optional[Mapping[str, str]] = None) -> List[Source]:
    """find() for every tag; one SourceUnavailable naming all the missing tags."""
    env = os.environ if env is None else env
    if env.get("MEGATRON_LM_DIR"):
        return [find(tag, env) for tag in tags]
    found, missing = [], []
    for tag in tags:
        try:
            found.append(find(tag, env))
        except SourceUnavailable:
            missing.append(tag)
    if missing:
        raise SourceUnavailable(unavailable_message(missing, env))
    return found


def _extract(archive: Path, dest: Path) -> Path:
    """Unpack a release snapshot under `dest`; the path of its one top folder."""
    with tarfile.open(archive) as tar:
        tops = {Path(name).parts[0] for name in tar.getnames() if Path(name).parts}
        if len(tops) != 1:
            raise SourceUnavailable(f"{archive}: not one top folder ({len(tops)} found)")
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, filter="data")
        else:  # Python without extraction filters: refuse what the "data" filter refuses
            for member in tar.getmembers():
                path = Path(member.name)
                if path.is_absolute() or ".." in path.parts or member.issym() or member.islnk():
                    raise SourceUnavailable(f"{archive}: unsafe member {member.name}")
            tar.extractall(dest)
    tree = dest / tops.pop()
    if not (tree / "pretrain_gpt.py").is_file():
        raise SourceUnavailable(f"{archive} has no pretrain_gpt.py in its top folder")
    return tree


def _clone(repo: str, tag: str, cache: Path) -> Path:
    """A shallow clone of `tag` into the cache (made beside it, then moved in place)."""
    cache.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{tag}-", dir=cache.parent))
    try:
        subprocess.run(
            ["git", "clone", "-q", "--depth", "1", "--branch", tag, repo, str(scratch / tag)],
            env={**os.environ, "GIT_TERMINAL_PROMPT": "0"},
            check=True,
            timeout=CLONE_TIMEOUT_S,
        )
        os.replace(scratch / tag, cache)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return cache


def materialise(source: Source, dest: Path, env: Optional[Mapping[str, str]] = None) -> Path:
    """A tree of `source` under `dest` (unpacked, or copied without .git) that the caller may
    patch; returns its path, which holds pretrain_gpt.py."""
    env = os.environ if env is None else env
    dest.mkdir(parents=True, exist_ok=True)
    if source.kind == "archive":
        return _extract(Path(source.location), dest)
    origin = Path(source.location)
    if source.kind == "clone":
        origin = _clone(source.location, source.tag, cache_folder(env) / source.tag)
    tree = dest / f"megatron-lm-{source.tag}"
    shutil.copytree(origin, tree, ignore=shutil.ignore_patterns(".git"))
    return tree


def main(argv: Optional[Sequence[str]] = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="say where each tag's sources come from")
    check.add_argument("tags", nargs="+", metavar="TAG")
    tree = sub.add_parser("tree", help="unpack or copy TAG's sources under DEST, print the path")
    tree.add_argument("tag", metavar="TAG")
    tree.add_argument("dest", type=Path, metavar="DEST")
    args = parser.parse_args(argv)
    try:
        if args.command == "check":
            for source in find_all(args.tags):
                print(source)
        else:
            print(materialise(find(args.tag), args.dest))
    except SourceUnavailable as error:
        print(error, file=sys.stderr)
        return UNAVAILABLE_EXIT
    return 0


if __name__ == "__main__":
    sys.exit(main())

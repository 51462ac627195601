"""tests/megatron_lm_source.py: which source a tag's Megatron-LM comes from, in order, what each
unpacks to, and the one-line message when none has it. Real archives and a real git repository
(file://), no network."""

import io
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests import megatron_lm_source as mls

TAG = "core_v0.19.0"
SCRIPT = Path(mls.__file__)


def write_archive(folder: Path, tag: str, top: str, extra=()) -> Path:
    """<folder>/<tag>.tar.gz holding <top>/pretrain_gpt.py and `extra` (name, text) files, or
    (name, "->target") symbolic links."""
    folder.mkdir(parents=True, exist_ok=True)
    archive = folder / f"{tag}.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for name, text in [(f"{top}/pretrain_gpt.py", f"# {tag}\n"), *extra]:
            info = tarfile.TarInfo(name)
            if text.startswith("->"):
                info.type, info.linkname = tarfile.SYMTYPE, text[2:]
                tar.addfile(info)
                continue
            data = text.encode()
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return archive


def git_repo_with_tag(path: Path, tag: str) -> str:
    path.mkdir(parents=True)
    (path / "pretrain_gpt.py").write_text(f"# {tag}\n")
    git = ["git", "-C", str(path), "-c", "user.name=t", "-c", "user.email=t@localhost"]
    for command in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", tag], ["tag", tag]):
        subprocess.run(git + command, check=True)
    return f"file://{path}"


def env_of(tmp_path: Path, **values) -> dict:
    """An environment with nothing set but a cache under tmp_path, no clone, and `values`."""
    return {"MEGATRON_LM_CACHE": str(tmp_path / "cache"), "MEGATRON_LM_REPO": "", **values}


@pytest.mark.parametrize("top", ["Megatron-LM-core_v0.19.0", "megatron-lm-core_v0.19.0"])
def test_an_archive_unpacks_to_its_top_folder(tmp_path, top):
    write_archive(tmp_path / "snapshots", TAG, top)
    env = env_of(tmp_path, MEGATRON_LM_ARCHIVES=str(tmp_path / "snapshots"))
    source = mls.find(TAG, env)
    assert (source.kind, Path(source.location).name) == ("archive", f"{TAG}.tar.gz")
    tree = mls.materialise(source, tmp_path / "dest", env)
    assert tree == tmp_path / "dest" / top
    assert (tree / "pretrain_gpt.py").read_text() == f"# {TAG}\n"


def test_archive_folders_are_searched_in_order_older_name_included(tmp_path):
    write_archive(tmp_path / "b", TAG, "Megatron-LM-b")
    write_archive(tmp_path / "c", TAG, "Megatron-LM-c")
    env = env_of(tmp_path, MEGATRON_LM_ARCHIVES=f"{tmp_path / 'a'}:{tmp_path / 'b'}")
    assert mls.find(TAG, env).location == str(tmp_path / "b" / f"{TAG}.tar.gz")
    env = env_of(tmp_path, E2E_MEGATRON_LM_ARCHIVES=str(tmp_path / "c"))
    assert mls.find(TAG, env).location == str(tmp_path / "c" / f"{TAG}.tar.gz")


def test_a_checkout_comes_first_and_is_copied_without_git(tmp_path):
    write_archive(tmp_path / "snapshots", TAG, "Megatron-LM-x")
    git_repo_with_tag(tmp_path / "checkout", TAG)
    env = env_of(
        tmp_path,
        MEGATRON_LM_DIR=str(tmp_path / "checkout"),
        MEGATRON_LM_ARCHIVES=str(tmp_path / "snapshots"),
    )
    source = mls.find(TAG, env)
    assert source.kind == "checkout"
    tree = mls.materialise(source, tmp_path / "dest", env)
    assert (tree / "pretrain_gpt.py").is_file() and not (tree / ".git").exists()


def test_a_checkout_without_pretrain_gpt_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    env = env_of(tmp_path, MEGATRON_LM_DIR=str(tmp_path / "empty"))
    with pytest.raises(mls.SourceUnavailable, match="has no pretrain_gpt.py"):
        mls.find_all([TAG], env)


def test_a_clone_is_made_once_and_then_read_from_the_cache(tmp_path):
    url = git_repo_with_tag(tmp_path / "upstream", TAG)
    env = env_of(tmp_path, MEGATRON_LM_REPO=url)
    source = mls.find(TAG, env)
    assert (source.kind, source.location) == ("clone", url)
    tree = mls.materialise(source, tmp_path / "dest", env)
    assert (tree / "pretrain_gpt.py").is_file() and not (tree / ".git").exists()
    assert (tmp_path / "cache" / TAG / "pretrain_gpt.py").is_file()
    env["MEGATRON_LM_REPO"] = ""  # no network needed any more
    assert mls.find(TAG, env).kind == "cache"
    with pytest.raises(mls.SourceUnavailable, match="core_v0.18.0"):
        mls.find("core_v0.18.0", env_of(tmp_path / "other", MEGATRON_LM_REPO=url))


def test_nowhere_is_one_line_naming_every_missing_tag_and_what_to_set(tmp_path):
    write_archive(tmp_path / "snapshots", TAG, "Megatron-LM-x")
    env = env_of(tmp_path, MEGATRON_LM_ARCHIVES=str(tmp_path / "snapshots"))
    with pytest.raises(mls.SourceUnavailable) as refused:
        mls.find_all(["core_v0.18.0", TAG, "core_v0.16.1"], env)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("Megatron-LM core_v0.18.0 core_v0.16.1: no sources found")
    for name in ("MEGATRON_LM_ARCHIVES", "MEGATRON_LM_DIR", "MEGATRON_LM_REPO to a git URL"):
        assert name in message
    env["MEGATRON_LM_REPO"] = "file:///nowhere/Megatron-LM.git"
    with pytest.raises(
        mls.SourceUnavailable, match="let git reach file:///nowhere/Megatron-LM.git"
    ):
        mls.find("core_v0.18.0", env)


@pytest.mark.parametrize(
    "extra, match",
    [
        ([("Other-top/README", "x")], "not one top folder"),
        ([("../escape.py", "x")], "not one top folder"),
        ([("Megatron-LM-x/up", "->../.."), ("Megatron-LM-x/up/escape.py", "x")], "outside|unsafe"),
    ],
    ids=["two-tops", "dot-dot", "link-out"],
)
def test_bad_archives_are_refused(tmp_path, extra, match):
    write_archive(tmp_path / "snapshots", TAG, "Megatron-LM-x", extra)
    env = env_of(tmp_path, MEGATRON_LM_ARCHIVES=str(tmp_path / "snapshots"))
    with pytest.raises((mls.SourceUnavailable, tarfile.TarError), match=match):
        mls.materialise(mls.find(TAG, env), tmp_path / "dest", env)
    assert not (tmp_path / "escape.py").exists()


def test_command_line(tmp_path, monkeypatch):
    write_archive(tmp_path / "snapshots", TAG, "Megatron-LM-x")
    env = env_of(tmp_path, MEGATRON_LM_ARCHIVES=str(tmp_path / "snapshots"), PATH="/usr/bin:/bin")

    def run(*args):
        return subprocess.run(
            [sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True
        )

    done = run("check", TAG)
    assert done.returncode == 0 and done.stdout.startswith(f"Megatron-LM {TAG}: archive ")
    done = run("tree", TAG, str(tmp_path / "dest"))
    assert done.returncode == 0
    assert Path(done.stdout.strip()) == tmp_path / "dest" / "Megatron-LM-x"
    done = run("check", TAG, "core_v0.18.0")
    assert done.returncode == mls.UNAVAILABLE_EXIT and done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1 and "core_v0.18.0" in done.stderr


def test_without_extraction_filters_unsafe_members_are_refused_too(tmp_path, monkeypatch):
    monkeypatch.delattr(tarfile, "data_filter")
    good = write_archive(tmp_path / "good", TAG, "Megatron-LM-x")
    assert (mls._extract(good, tmp_path / "dest") / "pretrain_gpt.py").is_file()
    linked = [("Megatron-LM-x/up", "->../.."), ("Megatron-LM-x/up/escape.py", "x")]
    bad = write_archive(tmp_path / "bad", TAG, "Megatron-LM-x", linked)
    with pytest.raises(mls.SourceUnavailable, match="unsafe member Megatron-LM-x/up"):
        mls._extract(bad, tmp_path / "dest2")
    assert not (tmp_path / "escape.py").exists()

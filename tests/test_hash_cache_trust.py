"""The hash cache believes only a folder and entries that no one else can write
(issue 27, item 6): whoever can write them would choose the digest believed."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support import Checkpoints, DaemonPool, get_model
from weightcache.core.checkpoint import SINGLE_FILE, open_checkpoint
from weightcache.core.fingerprint import DEFAULT_LEVEL, compute_fingerprint
from weightcache.core.hashcache import file_sha256
from weightcache.core.protocol import fingerprint_from_pb
from weightcache.core.recipe import Placement, Recipe

NOBODY = 65534
ROOT = os.geteuid() == 0
FAKE = "0" * 64


def _key(path: Path) -> str:
    st = os.stat(path)
    return f"{st.st_dev}-{st.st_ino}-{st.st_size}-{st.st_mtime_ns}-{st.st_ctime_ns}"


def _plant(folder: Path, target: Path) -> Path:
    """A well-formed entry claiming :data:`FAKE` for ``target``, read long after it changed."""
    st = os.stat(target)
    entry = folder / _key(target)
    entry.write_text(f"{FAKE} {max(st.st_mtime_ns, st.st_ctime_ns) + 10**10}")
    os.chmod(entry, 0o600)
    return entry


def _folder_of_another_user(folder: Path, entry: Path) -> None:
    os.chown(folder, NOBODY, NOBODY)


def _folder_writable_by_others(folder: Path, entry: Path) -> None:
    os.chmod(folder, 0o777)


def _folder_writable_by_group(folder: Path, entry: Path) -> None:
    os.chmod(folder, 0o770)


def _entry_of_another_user(folder: Path, entry: Path) -> None:
    os.chown(entry, NOBODY, NOBODY)


def _entry_writable_by_others(folder: Path, entry: Path) -> None:
    os.chmod(entry, 0o646)


def _entry_is_a_symlink(folder: Path, entry: Path) -> None:
    real = folder.parent / "elsewhere"
    entry.rename(real)
    entry.symlink_to(real)


UNTRUSTED: dict[str, tuple[Callable[[Path, Path], None], bool]] = {
    "folder-of-another-user": (_folder_of_another_user, True),
    "folder-writable-by-others": (_folder_writable_by_others, False),
    "folder-writable-by-group": (_folder_writable_by_group, False),
    "entry-of-another-user": (_entry_of_another_user, True),
    "entry-writable-by-others": (_entry_writable_by_others, False),
    "entry-is-a-symlink": (_entry_is_a_symlink, False),
}


@pytest.fixture
def shard(tmp_path: Path) -> Path:
    path = tmp_path / "file.bin"
    path.write_bytes(b"the real bytes" * 1000)
    os.utime(path, ns=(10**9, 10**9))  # long ago: a digest of it may be remembered
    return path


def test_a_private_cache_is_believed(tmp_path: Path, shard: Path) -> None:
    """The control: a planted entry in a folder and file of our own is taken as it is
    (which is why only we may write them)."""
    folder = tmp_path / "cache"
    folder.mkdir(mode=0o700)
    _plant(folder, shard)

    assert file_sha256(shard, cache=folder) == FAKE


@pytest.mark.parametrize("case", list(UNTRUSTED))
def test_a_cache_others_can_write_is_ignored(
    tmp_path: Path, shard: Path, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    spoil, needs_root = UNTRUSTED[case]
    if needs_root and not ROOT:
        pytest.skip("needs root to give a file to another user")
    folder = tmp_path / "cache"
    folder.mkdir(mode=0o700)
    entry = _plant(folder, shard)
    spoil(folder, entry)

    digest = file_sha256(shard, cache=folder)

    assert digest == hashlib.sha256(shard.read_bytes()).hexdigest()
    if case.startswith("folder"):
        [record] = [r for r in caplog.records if r.name == "weightcache.hashcache"]
        assert str(folder) in record.getMessage()
        assert "ignored, files are hashed and nothing is remembered" in record.getMessage()


def test_the_daemon_ignores_a_hash_cache_folder_of_another_user(
    daemons: DaemonPool, checkpoints: Checkpoints, tmp_path: Path
) -> None:
    if not ROOT:
        pytest.skip("needs root to give a folder to another user")
    folder = tmp_path / "cache"
    folder.mkdir(mode=0o700)
    _plant(folder, checkpoints.single / SINGLE_FILE)
    os.chown(folder, NOBODY, NOBODY)
    with open_checkpoint(checkpoints.single) as checkpoint:
        expected = compute_fingerprint(checkpoint, Recipe(), Placement(), DEFAULT_LEVEL)

    daemon = daemons.start([checkpoints.single], env={"WEIGHTCACHE_HASH_CACHE": str(folder)})

    held = fingerprint_from_pb(get_model(daemon.socket, "single").fingerprint)
    assert held == expected
    assert f"hash cache folder {folder} belongs to uid {NOBODY}, not 0" in daemon.log()
    assert sorted(os.listdir(folder)) == [_key(checkpoints.single / SINGLE_FILE)]

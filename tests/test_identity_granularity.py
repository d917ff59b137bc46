"""A file's identity never vouches for bytes it cannot vouch for (issue 27, item 1).

(b) On a file system with 1-second timestamps (ext4 with 128-byte inodes, as ext3 made
them), a same-size rewrite within the second of the daemon's read keeps dev, inode, size,
mtime and ctime. (a) A write through a shared mapping stamps the file only when it first
dirties a page. In both, a worker whose file now differs must get its own bytes (from
disk, ``FINGERPRINT_MISMATCH``), never the daemon's older ones by identity or by a
remembered digest. The rule: :mod:`weightcache.core.timestamps`.
"""

from __future__ import annotations

import mmap
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.recipe_support import preload
from tests.support import Daemon, DaemonPool, WorkerPool, assert_bitwise_equal
from weightcache.core.timestamps import FINE_GRANULE_NS, SECOND_NS, fs_type, granule_ns
from weightcache.v1 import weight_cache_service_pb2 as pb

FULL = pb.FINGERPRINT_LEVEL_FULL


@pytest.fixture(scope="module")
def coarse_fs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """An ext4 file system with 128-byte inodes (whole-second timestamps), loop-mounted
    for this module (root, mkfs.ext4 and a loop device needed)."""
    if os.geteuid() != 0 or shutil.which("mkfs.ext4") is None:
        pytest.skip("needs root and mkfs.ext4 to mount a file system with 1 s timestamps")
    base = tmp_path_factory.mktemp("coarse")
    image, mount = base / "fs.img", base / "mnt"
    mount.mkdir()
    with open(image, "wb") as fh:
        fh.truncate(32 * 2**20)
    made = subprocess.run(
        ["mkfs.ext4", "-q", "-F", "-I", "128", str(image)], capture_output=True, check=False
    )
    mounted = made.returncode == 0 and (
        subprocess.run(
            ["mount", "-o", "loop", str(image), str(mount)], capture_output=True, check=False
        ).returncode
        == 0
    )
    if not mounted:
        pytest.skip("cannot loop-mount an ext4 image here")
    try:
        os.chmod(mount, 0o755)
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)
        image.unlink()


@pytest.fixture(scope="module")
def fine_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder on the disk file system of the temporary folder (nanosecond stamps), not
    tmpfs: a file system that writes pages back."""
    root = tmp_path_factory.mktemp("fine")
    if fs_type(os.stat(root).st_dev) in ("tmpfs", ""):
        pytest.skip("the temporary folder is on tmpfs, which never writes pages back")
    return root


@pytest.fixture(scope="module")
def remote(module_daemons: DaemonPool, coarse_fs: Path, fine_root: Path) -> Daemon:
    return module_daemons.start(
        [],
        args=[
            "--allow-remote-preload",
            "--model-root",
            str(coarse_fs),
            "--model-root",
            str(fine_root),
        ],
    )


def _tensors(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((64, 64), value, dtype=torch.float32)}


def _identity(path: Path) -> tuple[int, int, int, int, int]:
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _start_of_a_second() -> None:
    time.sleep(1.02 - time.time() % 1)


def _evict(socket: str, name: str) -> None:
    from tests.support import service_stub

    with service_stub(socket) as stub:
        stub.Evict(pb.EvictRequest(name=name), timeout=10)


def test_a_rewrite_within_the_second_on_a_1_second_file_system_is_seen(
    remote: Daemon, coarse_fs: Path, workers: WorkerPool, tmp_path: Path
) -> None:
    folder = coarse_fs / "rewritten"
    folder.mkdir(exist_ok=True)
    shard = folder / "model.safetensors"
    new = tmp_path / "new.safetensors"
    save_file(_tensors(2.0), str(new))
    for _ in range(5):  # the steps must fall in one second of the clock
        _start_of_a_second()
        save_file(_tensors(1.0), str(shard))
        before = _identity(shard)
        done = preload(remote.socket, folder, level=FULL)[-1]
        with open(shard, "r+b") as fh:  # in place: same inode, same size
            fh.write(new.read_bytes())
        if _identity(shard) == before:
            break
        _evict(remote.socket, done.model)
    else:
        pytest.fail("could not rewrite the file within one second five times")
    assert done.state == pb.MODEL_STATE_READY
    assert granule_ns(before[0], before[3], before[4]) == SECOND_NS

    reply = workers.start().load(folder, socket=remote.socket, dump=tmp_path / "w")

    assert reply["ok"], reply
    assert reply["source"] == "disk"
    assert reply["fallback_reason"]["code"] == "FINGERPRINT_MISMATCH"
    assert_bitwise_equal(load_file(tmp_path / "w"), _tensors(2.0))
    _evict(remote.socket, done.model)


def test_a_write_through_a_shared_mapping_after_the_read_is_seen(
    remote: Daemon, fine_root: Path, workers: WorkerPool, tmp_path: Path
) -> None:
    folder = fine_root / "mapped"
    folder.mkdir()
    shard = folder / "model.safetensors"
    save_file(_tensors(1.0), str(shard))
    data_start = 8 + int.from_bytes(shard.read_bytes()[:8], "little")
    with open(shard, "r+b") as fh, mmap.mmap(fh.fileno(), 0) as mapped:
        mapped[data_start : data_start + 4] = torch.tensor([3.0]).numpy().tobytes()
        # The page is dirty now, and stays so (writeback comes after 30 s): the next write
        # through the mapping stamps nothing unless the page is written back first.
        time.sleep(4 * FINE_GRANULE_NS / 1e9)
        done = preload(remote.socket, folder, level=FULL)[-1]
        before = _identity(shard)
        mapped[data_start : data_start + 4] = torch.tensor([5.0]).numpy().tobytes()
        mapped.flush()
    assert done.state == pb.MODEL_STATE_READY
    expected = _tensors(1.0)
    expected["w"].view(-1)[0] = 5.0

    reply = workers.start().load(folder, socket=remote.socket, dump=tmp_path / "w")

    assert _identity(shard) != before  # the write after the daemon's read stamped the file
    assert reply["ok"], reply
    assert reply["source"] == "disk"
    assert reply["fallback_reason"]["code"] == "FINGERPRINT_MISMATCH"
    assert_bitwise_equal(load_file(tmp_path / "w"), expected)
    _evict(remote.socket, done.model)

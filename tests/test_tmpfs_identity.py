"""File identity on tmpfs (issue 36): a write through a shared mapping of a checkpoint on
tmpfs keeps its dev, inode, size, mtime and ctime, so identity never vouches there; an
Acquire by file identity is refused saying why, and the worker's fingerprint, computed from
the bytes, serves no stale byte."""

from __future__ import annotations

import json
import mmap
import os
import shutil
import struct
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load_file

import weightcache
from tests.support import (
    SHARD_2,
    Checkpoints,
    DaemonPool,
    WorkerPool,
    assert_bitwise_equal,
    raw_bytes,
    rpc_failure,
    service_stub,
)
from tests.test_attach_by_files import _by_files
from weightcache.core.checkpoint import file_identities
from weightcache.core.sockets import SHM_DIR
from weightcache.core.timestamps import fs_type, stamps_every_write, vouches
from weightcache.testing.checkpoints import wait_until_settled

pytestmark = pytest.mark.skipif(
    fs_type(os.stat(SHM_DIR).st_dev) != "tmpfs", reason=f"{SHM_DIR} is not a tmpfs here"
)


@pytest.fixture
def on_tmpfs(checkpoints: Checkpoints) -> Iterator[Path]:
    """A copy of ``sharded`` in a folder of this test's own under /dev/shm (a tmpfs),
    removed after it; its name is not a daemon segment's (``weightcache-...``)."""
    root = Path(SHM_DIR) / f"wc-test-tmpfs-{uuid.uuid4().hex}"
    try:
        shutil.copytree(checkpoints.sharded, root / "sharded")
        yield root / "sharded"
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _data_offset(shard: Path) -> tuple[str, int, int]:
    """The first tensor of ``shard`` by offset: its name, byte offset in the file, size."""
    with open(shard, "rb") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(length))
    header.pop("__metadata__", None)
    name, info = min(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
    start, end = info["data_offsets"]
    return name, 8 + length + start, end - start


def test_identity_never_vouches_on_tmpfs(on_tmpfs: Path) -> None:
    info = os.stat(on_tmpfs / SHARD_2)
    assert stamps_every_write(info.st_dev) is False
    # Even a file last changed long ago, read now.
    assert vouches(info.st_dev, 1, 1, info.st_mtime_ns + 10**12) is False
    wait_until_settled(on_tmpfs, timeout=0.1)  # does not wait for what never settles
    assert stamps_every_write(os.stat(Path(__file__)).st_dev) == (
        fs_type(os.stat(Path(__file__)).st_dev) not in ("tmpfs", "ramfs", "hugetlbfs")
    )


def test_a_write_through_a_shared_mapping_serves_no_stale_byte(
    on_tmpfs: Path,
    checkpoints: Checkpoints,
    daemons: DaemonPool,
    workers: WorkerPool,
    tmp_path: Path,
) -> None:
    shard = on_tmpfs / SHARD_2
    name, offset, size = _data_offset(shard)
    with open(shard, "r+b") as fh, mmap.mmap(fh.fileno(), 0) as mapped:
        # The writer maps and dirties the page before the daemon reads the file: tmpfs
        # never cleans it, so later writes to it fault no more and stamp nothing.
        mapped[offset : offset + size] = mapped[offset : offset + size]
        daemon = daemons.start([on_tmpfs])
        found = file_identities(on_tmpfs)
        assert found is not None
        as_read = found[1]  # the identities the daemon recorded (nothing wrote since)
        mapped[offset : offset + size] = bytes(b ^ 0xFF for b in mapped[offset : offset + size])
    # The repro: on the kernels measured (Linux 6.18) the identity is unchanged here. A
    # kernel that refaulted the page would stamp the file; the request below names the
    # identities as the daemon read them either way, so it is the tmpfs case.

    # An Acquire by those identities is refused, saying why.
    with service_stub(daemon.socket) as stub, pytest.raises(grpc.RpcError) as raised:
        stub.Acquire(_by_files(on_tmpfs, files=as_read), timeout=30)
    failure = rpc_failure(raised.value)
    assert (failure.code, failure.reason) == (grpc.StatusCode.NOT_FOUND, "MODEL_NOT_FOUND")
    assert "they are on tmpfs, where a write through a shared mapping" in failure.message
    assert failure.metadata["model"] == "sharded"

    # A worker then asks by its fingerprint of the bytes: a mismatch naming the shard,
    # and the new bytes from disk.
    reply = workers.start().load(on_tmpfs, socket=daemon.socket, dump=tmp_path / "got")
    assert reply["ok"], reply.get("error")
    assert reply["source"] == "disk"
    assert reply["fallback_reason"]["code"] == "FINGERPRINT_MISMATCH"
    assert reply["fallback_reason"]["components"] == [f"checkpoint/{SHARD_2}"]
    got = load_file(tmp_path / "got")
    assert_bitwise_equal(got, weightcache.load_from_disk(on_tmpfs, mode="copy").tensors)
    assert torch.equal(raw_bytes(got[name]), raw_bytes(checkpoints.tensors[name]) ^ 0xFF)


def test_unchanged_files_on_tmpfs_attach_by_fingerprint(
    on_tmpfs: Path,
    checkpoints: Checkpoints,
    daemons: DaemonPool,
    workers: WorkerPool,
    tmp_path: Path,
) -> None:
    daemon = daemons.start([on_tmpfs])

    reply = workers.start().load(on_tmpfs, socket=daemon.socket, dump=tmp_path / "got")

    assert (reply["source"], reply["fallback_reason"]) == ("cache", None)
    assert "match=fingerprint" in daemon.log()
    assert "match=files" not in daemon.log()
    assert_bitwise_equal(load_file(tmp_path / "got"), checkpoints.tensors)

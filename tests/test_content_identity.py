"""The default fingerprint covers every byte: a checkpoint that differs from the daemon's
in content, however little and however disguised, is refused with FINGERPRINT_MISMATCH
naming the shard, and loads from disk with its own bytes."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import weightcache
from tests.recipe_support import write_hub_repo
from tests.support import (
    SHARD_2,
    SMALL_TENSOR,
    Checkpoints,
    DaemonPool,
    WorkerPool,
    assert_bitwise_equal,
)
from weightcache.core.checkpoint import open_checkpoint
from weightcache.core.fingerprint import DEFAULT_LEVEL, compute_fingerprint
from weightcache.core.recipe import Placement, Recipe

COMMIT = "feedfacefeedfacefeedfacefeedfacefeedface"
#: A 1 MiB tensor: 262144 F32 elements.
BIG = "big.weight"


def _fell_back(reply: dict[str, Any], components: list[str]) -> None:
    assert reply["ok"], reply
    assert reply["source"] == "disk"
    reason = reply["fallback_reason"]
    assert reason["code"] == "FINGERPRINT_MISMATCH", reason
    assert sorted(reason["components"]) == components


def _rewrite_in_place(path: Path, offset: int, data: bytes) -> None:
    """Overwrite bytes of ``path`` in place, then put its mtime back as it was."""
    before = os.stat(path)
    with open(path, "r+b") as fh:
        fh.seek(offset)
        fh.write(data)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert os.stat(path).st_mtime_ns == before.st_mtime_ns


def test_the_default_level_is_full() -> None:
    assert DEFAULT_LEVEL == "full"


def test_a_corrupt_hub_blob_under_its_right_name_is_a_mismatch(
    daemons: DaemonPool, workers: WorkerPool, checkpoints: Checkpoints, tmp_path: Path
) -> None:
    good = write_hub_repo(tmp_path / "good", "acme/m", checkpoints.sharded, COMMIT)
    daemon = daemons.start([good.snapshot])
    bad = write_hub_repo(tmp_path / "bad", "acme/m", checkpoints.sharded, COMMIT)
    blob = bad.blobs[SHARD_2]
    assert blob.name == good.blobs[SHARD_2].name
    info = open_checkpoint(bad.snapshot).tensors[SMALL_TENSOR]
    _rewrite_in_place(blob, info.begin, bytes(info.nbytes))  # zeros, same size and name

    reply = workers.start().load(bad.snapshot, socket=daemon.socket, dump=tmp_path / "w")

    _fell_back(reply, [f"checkpoint/{SHARD_2}"])
    got = load_file(tmp_path / "w")
    assert not got[SMALL_TENSOR].any()
    assert_bitwise_equal(got, weightcache.load_from_disk(bad.snapshot).tensors)


def test_an_in_place_rewrite_with_its_mtime_restored_is_a_mismatch(
    daemons: DaemonPool, workers: WorkerPool, checkpoints: Checkpoints, tmp_path: Path
) -> None:
    folder = tmp_path / "sharded"
    shutil.copytree(checkpoints.sharded, folder)
    daemon = daemons.start([folder])
    worker = workers.start()
    assert worker.load(folder, socket=daemon.socket, fallback=False)["source"] == "cache"
    info = open_checkpoint(folder).tensors[SMALL_TENSOR]

    _rewrite_in_place(folder / SHARD_2, info.begin, bytes(info.nbytes))
    reply = worker.load(folder, key="again", socket=daemon.socket, dump=tmp_path / "w")

    _fell_back(reply, [f"checkpoint/{SHARD_2}"])
    assert not load_file(tmp_path / "w")[SMALL_TENSOR].any()


@pytest.fixture
def big(tmp_path: Path) -> Path:
    """A checkpoint with a 1 MiB F32 tensor (and a small one)."""
    folder = tmp_path / "big"
    folder.mkdir()
    tensors = {
        BIG: torch.arange(262144, dtype=torch.float32).reshape(512, 512),
        "norm.weight": torch.ones(512),
    }
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def test_one_element_edited_in_a_1_mib_tensor_is_a_mismatch_at_the_default_level(
    daemons: DaemonPool, workers: WorkerPool, big: Path, tmp_path: Path
) -> None:
    daemon = daemons.start([big])
    edited = tmp_path / "edited"
    shutil.copytree(big, edited)
    info = open_checkpoint(edited).tensors[BIG]
    middle = info.begin + 4 * (131072 + 256)  # element [256, 256], in no sample
    with open(edited / "model.safetensors", "r+b") as fh:
        fh.seek(middle)
        fh.write(torch.tensor([-1.0]).numpy().tobytes())

    reply = workers.start().load(edited, socket=daemon.socket, dump=tmp_path / "w")

    _fell_back(reply, ["checkpoint/model.safetensors"])
    assert load_file(tmp_path / "w")[BIG][256, 256].item() == -1.0
    # The edit is where the sampled level does not look: it would have attached.
    sampled = [
        compute_fingerprint(open_checkpoint(f), Recipe(), Placement(), "sampled")
        for f in (big, edited)
    ]
    assert sampled[0] == sampled[1]

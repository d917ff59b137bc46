"""The disk path (weightcache._disk), in process: shards mapped as load_file maps them, the
same checks as before (issue 29, item 1).

A rewritten or truncated shard is changed while a load holds at the ``pause`` plugin
(``tests/plugins``): ``at=plan`` holds after the headers were validated and before the
fingerprint and the mapping, and leaves every tensor the stored one, so that the whole
checkpoint takes the mapped path; by default it holds at the first tensor, after the
other tensors were mapped and before the shards' identity is checked.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import shutil
import struct
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import weightcache
from tests.race_support import pause_step, rewrite_data_in_place, wait_reached
from tests.recipe_support import PLUGINS
from tests.support import SHARD_1, SHARD_2, Checkpoints
from weightcache.core.timestamps import FINE_GRANULE_NS, fs_type, settle
from weightcache.testing import assert_bitwise_equal


def _open_fds() -> list[str]:
    return sorted(os.listdir("/proc/self/fd"))


def _mapped_file(tensor: torch.Tensor) -> str | None:
    """The file whose mapping holds the tensor's first byte (/proc/self/maps), or None
    (private memory: the heap or an anonymous mapping)."""
    address = tensor.data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, _, _, _, inode, *path = line.split(maxsplit=5)
            begin, end = (int(x, 16) for x in span.split("-"))
            if begin <= address < end:
                return path[0].strip() if inode != "0" and path else None
    return None


def _where(tensors: dict[str, torch.Tensor]) -> dict[str, str | None]:
    return {name: _mapped_file(t) for name, t in tensors.items() if t.numel()}


def test_zero_copy_maps_every_stored_tensor_and_holds_no_descriptor(
    checkpoints: Checkpoints,
) -> None:
    fds = _open_fds()
    weights = weightcache.load_from_disk(checkpoints.sharded)

    assert weights.source == "disk"
    assert list(weights.tensors) == list(weightcache.open_checkpoint(checkpoints.sharded).tensors)
    assert_bitwise_equal(weights.tensors, checkpoints.tensors)
    shard_of = {n: i.shard for n, i in weights.checkpoint.tensors.items()}
    assert _where(weights.tensors) == {
        name: os.path.realpath(checkpoints.sharded / shard_of[name])
        for name, t in checkpoints.tensors.items()
        if t.numel()
    }
    assert _open_fds() == fds  # the mappings hold no descriptor


def test_copy_mode_reads_into_private_memory(checkpoints: Checkpoints) -> None:
    weights = weightcache.load_from_disk(checkpoints.sharded, mode="copy")

    assert_bitwise_equal(weights.tensors, checkpoints.tensors)
    assert set(_where(weights.tensors).values()) == {None}


def test_writing_a_mapped_tensor_leaves_the_file_as_it_was(
    checkpoints: Checkpoints, tmp_path: Path
) -> None:
    folder = tmp_path / "model"
    shutil.copytree(checkpoints.sharded, folder)
    before = (folder / SHARD_1).read_bytes()
    weights = weightcache.load_from_disk(folder)

    weights.tensors["embed.weight"].fill_(1.5)

    assert (folder / SHARD_1).read_bytes() == before
    again = weightcache.load_from_disk(folder)
    assert torch.equal(again.tensors["embed.weight"].view(torch.int16),
                       checkpoints.tensors["embed.weight"].view(torch.int16))  # fmt: skip


def test_the_fallback_of_load_maps_too_and_a_cast_is_computed(
    checkpoints: Checkpoints, tmp_path: Path
) -> None:
    absent = str(tmp_path / "none.sock")

    plain = weightcache.load(checkpoints.sharded, socket=absent)
    cast = weightcache.load(checkpoints.sharded, socket=absent, dtype="F16")

    assert plain.source == cast.source == "disk"
    assert plain.fallback_reason is not None
    assert plain.fallback_reason.code == "DAEMON_UNAVAILABLE"
    assert_bitwise_equal(plain.tensors, checkpoints.tensors)
    assert _mapped_file(plain.tensors["embed.weight"]) == str(checkpoints.sharded / SHARD_1)
    # A cast tensor is new memory; a tensor the cast leaves alone (bool) stays mapped.
    assert _mapped_file(cast.tensors["embed.weight"]) is None
    assert _mapped_file(cast.tensors["layers.0.mask"]) == str(checkpoints.sharded / SHARD_2)
    expected = {
        n: t.to(torch.float16) if t.dtype in (torch.bfloat16, torch.float32) else t
        for n, t in checkpoints.tensors.items()
    }
    assert_bitwise_equal(cast.tensors, expected)


def _write_misaligned(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file, written by hand, whose F32 tensor starts 3 bytes into the data
    (no writer of safetensors does that, but the format allows it); its tensors."""
    tensors = {
        "a.bytes": torch.tensor([7, 8, 9], dtype=torch.uint8),
        "b.floats": torch.tensor([1.5, -2.0, 3.25], dtype=torch.float32),
    }
    header = {
        "a.bytes": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
        "b.floats": {"dtype": "F32", "shape": [3], "data_offsets": [3, 15]},
    }
    raw = json.dumps(header).encode()
    data = b"".join(t.numpy().tobytes() for t in tensors.values())
    path.parent.mkdir(parents=True)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return tensors


def test_a_misaligned_tensor_is_read_and_the_aligned_ones_mapped(tmp_path: Path) -> None:
    model = tmp_path / "misaligned" / "model.safetensors"
    tensors = _write_misaligned(model)

    weights = weightcache.load_from_disk(model.parent)

    assert_bitwise_equal(weights.tensors, tensors)
    assert_bitwise_equal(weights.tensors, load_file(model))
    assert _where(weights.tensors) == {"a.bytes": str(model), "b.floats": None}
    assert weights.tensors["b.floats"].data_ptr() % 4 == 0


def _load_while(
    folder: Path, pause: Path, change: Callable[[], None], *, at_plan: bool
) -> weightcache.InvalidCheckpointError:
    """``load_from_disk(folder)`` held at the ``pause`` plugin while ``change()`` runs;
    the error it ends with (the test fails when it returns weights)."""
    pause.mkdir()
    step = pause_step(pause) + (",at=plan" if at_plan else "")
    recipe = weightcache.Recipe(plugins=(weightcache.PluginStep.parse(step),))
    with futures.ThreadPoolExecutor(1) as pool:
        loading = pool.submit(weightcache.load_from_disk, folder, recipe=recipe)
        try:
            wait_reached(pause, lambda: not loading.done())
            change()
        finally:
            (pause / "go").touch()
        with pytest.raises(weightcache.InvalidCheckpointError) as raised:
            loading.result(timeout=60)
    return raised.value


@pytest.mark.parametrize(
    "change",
    ["rewritten in place", "truncated", "truncated after mapping"],
)
def test_a_shard_changed_while_loaded_is_refused_on_the_mapped_path(
    checkpoints: Checkpoints, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    monkeypatch.syspath_prepend(str(PLUGINS))
    folder = tmp_path / "model"
    shutil.copytree(checkpoints.sharded, folder)
    shard = folder / SHARD_2
    keep = 8 + int.from_bytes(shard.read_bytes()[:8], "little") + 1  # the header + 1 byte
    edits = {
        "rewritten in place": lambda: rewrite_data_in_place(shard),
        "truncated": lambda: os.truncate(shard, keep),
        "truncated after mapping": lambda: os.truncate(shard, keep),
    }
    fds = _open_fds()

    error = _load_while(
        folder, tmp_path / "pause", edits[change], at_plan=change != "truncated after mapping"
    )

    assert error.reason == "INVALID_CHECKPOINT"
    assert f"{SHARD_2}: the file changed while it was being loaded" in str(error)
    assert _open_fds() == fds  # the shard files were closed


def test_settle_writes_dirty_pages_back_without_fdatasync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``settle`` (run on every file the disk path opens) writes back with
    ``sync_file_range``, not ``fdatasync`` (3 ms a file here: issue 29), and still makes
    the next write through a shared mapping stamp the file."""
    if fs_type(os.stat(tmp_path).st_dev) in ("tmpfs", ""):
        pytest.skip("the temporary folder is on tmpfs, which never writes pages back")
    path = tmp_path / "shard"
    path.write_bytes(bytes(2 * mmap.PAGESIZE))
    fdatasyncs: list[int] = []
    monkeypatch.setattr(os, "fdatasync", fdatasyncs.append)
    with open(path, "r+b") as fh, mmap.mmap(fh.fileno(), 0) as mapped:
        mapped[0:1] = b"a"  # dirties the page: stamps the file once, not at later writes
        time.sleep(4 * FINE_GRANULE_NS / 1e9)
        fd = os.open(path, os.O_RDONLY)
        try:
            settle(fd)
        finally:
            os.close(fd)
        settled = os.stat(path).st_mtime_ns
        time.sleep(4 * FINE_GRANULE_NS / 1e9)
        mapped[1:2] = b"b"
        after = os.stat(path).st_mtime_ns

    assert fdatasyncs == []
    assert after > settled  # the write after settle faulted and stamped the file


def test_the_fingerprint_of_a_disk_load_is_computed_when_first_read(
    checkpoints: Checkpoints, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load from disk reads no byte for a fingerprint (issue 29: at the default level
    ``full`` an uncached shard would be hashed whole, several times ``load_file``'s time);
    the first read of ``fingerprint`` computes it from the same files, as the daemon does."""
    cache = tmp_path / "hash-cache"
    monkeypatch.setenv("WEIGHTCACHE_HASH_CACHE", str(cache))
    folder = tmp_path / "model"
    shutil.copytree(checkpoints.sharded, folder)
    time.sleep(4 * FINE_GRANULE_NS / 1e9)  # so that their identities vouch: cached when hashed
    absent = str(tmp_path / "none.sock")

    from_disk = weightcache.load_from_disk(folder)
    fallback = weightcache.load(folder, socket=absent)
    nothing_hashed = not cache.exists() or not any(cache.iterdir())

    first = from_disk.fingerprint
    with weightcache.open_checkpoint(folder) as checkpoint:
        expected = weightcache.compute_fingerprint(
            checkpoint, weightcache.Recipe(), weightcache.Placement()
        )
    assert nothing_hashed
    assert first == fallback.fingerprint == expected
    digests = {
        name: hashlib.sha256((folder / name).read_bytes()).hexdigest()
        for name in (SHARD_1, SHARD_2)
    }
    assert sorted(p.read_text().split()[0] for p in cache.iterdir()) == sorted(digests.values())
    assert_bitwise_equal(from_disk.tensors, checkpoints.tensors)


@pytest.mark.parametrize("mode", ["zero_copy", "copy"])
def test_a_fingerprint_read_after_its_files_changed_is_refused(
    checkpoints: Checkpoints, tmp_path: Path, mode: str
) -> None:
    folder = tmp_path / "model"
    shutil.copytree(checkpoints.sharded, folder)
    weights = weightcache.load_from_disk(folder, mode=mode)  # type: ignore[arg-type]
    replaced = folder / SHARD_2
    shutil.copyfile(checkpoints.sharded / SHARD_2, tmp_path / "new")
    os.replace(tmp_path / "new", replaced)  # same bytes, another file: another identity

    with pytest.raises(weightcache.InvalidCheckpointError) as raised:
        _ = weights.fingerprint

    assert raised.value.reason == "INVALID_CHECKPOINT"
    assert "a file changed since these weights were loaded" in str(raised.value)
    assert_bitwise_equal(weights.tensors, checkpoints.tensors)  # the old file stays mapped

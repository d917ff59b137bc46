"""Small deterministic safetensors checkpoints, and bitwise comparison of tensors.

:func:`reference_tensors` covers the cases a loader gets wrong: BF16, F16, F32, F8_E4M3,
BOOL and I64 tensors, a zero-size and a 0-d tensor, floats holding arbitrary bit patterns
(NaN payloads, infinities, -0.0, subnormals). The same seed always gives the same bytes.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from weightcache.core.timestamps import stamps_every_write, vouches

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SHARD_1 = "model-00001-of-00002.safetensors"
SHARD_2 = "model-00002-of-00002.safetensors"
#: A tensor of at most 192 bytes (sampled fingerprints cover all of it), in shard 2.
SMALL_TENSOR = "layers.1.norm.bias"
#: One key only: safetensors writes ``__metadata__`` from a hash map, in no fixed order.
METADATA = {"format": "pt"}


def _random_bits(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A tensor of ``dtype`` whose bytes are random: every bit pattern, NaN payloads too."""
    nbytes = math.prod(shape) * dtype.itemsize
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def reference_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """A checkpoint's worth of tensors, the same bytes for the same ``seed``.

    Returns:
        Nine tensors, names to CPU tensors: ``embed.weight`` (64, 32) BF16,
        ``layers.0.attn.weight`` (16, 24) F16, ``layers.0.mlp.weight`` (32, 33) F32,
        ``layers.0.mlp.fp8_weight`` (8, 16) F8_E4M3, ``layers.0.mask`` (5, 7) BOOL,
        ``layers.0.position_ids`` (33,) I64, ``layers.0.empty`` (0, 4) F32,
        ``layers.1.scale`` () F32 and :data:`SMALL_TENSOR` (8,) F32. Floats hold arbitrary
        bit patterns; ``embed.weight`` starts with NaN, -inf, -0.0 and a subnormal.
    """
    gen = torch.Generator().manual_seed(seed)
    embed = _random_bits((64, 32), torch.bfloat16, gen)
    embed.view(-1)[:4] = torch.tensor([float("nan"), float("-inf"), -0.0, 1e-40])
    return {
        "embed.weight": embed,
        "layers.0.attn.weight": _random_bits((16, 24), torch.float16, gen),
        "layers.0.mlp.weight": _random_bits((32, 33), torch.float32, gen),
        "layers.0.mlp.fp8_weight": _random_bits((8, 16), torch.float8_e4m3fn, gen),
        "layers.0.mask": torch.rand((5, 7), generator=gen) > 0.5,
        "layers.0.position_ids": torch.randint(-(2**62), 2**62, (33,), generator=gen),
        "layers.0.empty": torch.zeros((0, 4), dtype=torch.float32),
        "layers.1.scale": torch.tensor(-3.25 + seed, dtype=torch.float32),
        SMALL_TENSOR: torch.arange(1, 9, dtype=torch.float32) + seed,
    }


#: Which tensors of :func:`reference_tensors` go to which shard of a sharded checkpoint.
SHARD_OF: dict[str, str] = {
    "embed.weight": SHARD_1,
    "layers.0.attn.weight": SHARD_1,
    "layers.0.mlp.weight": SHARD_1,
    "layers.0.mlp.fp8_weight": SHARD_1,
    "layers.0.mask": SHARD_2,
    "layers.0.position_ids": SHARD_2,
    "layers.0.empty": SHARD_2,
    "layers.1.scale": SHARD_2,
    SMALL_TENSOR: SHARD_2,
}


def write_single(folder: Path, tensors: Mapping[str, torch.Tensor]) -> Path:
    """Create ``folder`` with one ``model.safetensors`` holding ``tensors``.

    Returns:
        ``folder``.

    Raises:
        FileExistsError: ``folder`` exists already.
    """
    folder.mkdir(parents=True)
    save_file(dict(tensors), str(folder / SINGLE_FILE), metadata=METADATA)
    return folder


def write_sharded(
    folder: Path, tensors: Mapping[str, torch.Tensor], shard_of: Mapping[str, str] = SHARD_OF
) -> Path:
    """Create ``folder`` with the shards ``shard_of`` names plus
    ``model.safetensors.index.json`` (its ``total_size``: the tensors' bytes).

    Returns:
        ``folder``.

    Raises:
        FileExistsError: ``folder`` exists already.
        KeyError: a tensor has no shard in ``shard_of``.
    """
    folder.mkdir(parents=True)
    weight_map = {name: shard_of[name] for name in tensors}
    for shard in sorted(set(weight_map.values())):
        part = {n: t for n, t in tensors.items() if weight_map[n] == shard}
        save_file(part, str(folder / shard), metadata=METADATA)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / INDEX_FILE).write_text(json.dumps(index))
    return folder


@dataclass(frozen=True)
class Checkpoints:
    """A set of small checkpoints (:func:`make_checkpoints`); copy one before editing it.

    Attributes:
        tensors: what ``single`` and ``sharded`` hold (:func:`reference_tensors`, seed 0).
        single: folder with one ``model.safetensors`` (model name ``single``).
        sharded: two shards and an index (model name ``sharded``).
        other: a single-file checkpoint with different tensor names (``other``): three F32
            tensors ``other.I`` of shape (3, I + 1) filled with I.
        other_sharded: ``sharded``'s layout and names with different bytes (seed 1).
    """

    tensors: dict[str, torch.Tensor]
    single: Path
    sharded: Path
    other: Path
    other_sharded: Path


def make_checkpoints(root: Path) -> Checkpoints:
    """Write the :class:`Checkpoints` under ``root`` (about 40 KiB in all).

    Raises:
        FileExistsError: one of its folders exists already under ``root``.
    """
    tensors = reference_tensors(seed=0)
    other = {f"other.{i}": torch.full((3, i + 1), float(i)) for i in range(3)}
    written = Checkpoints(
        tensors=tensors,
        single=write_single(root / "single", tensors),
        sharded=write_sharded(root / "sharded", tensors),
        other=write_single(root / "other", other),
        other_sharded=write_sharded(root / "other-sharded", reference_tensors(seed=1)),
    )
    # Past the timestamp granule, so that a daemon or SDK hashing them now may remember
    # their digests (weightcache.core.timestamps.vouches), as it would for any checkpoint
    # that was not written a moment ago.
    wait_until_settled(root)
    return written


def wait_until_settled(*paths: Path, timeout: float = 5.0) -> None:
    """Sleep until every regular file at or under ``paths`` was last changed (the later
    of mtime and ctime) more than its file system's timestamp granule ago: from then on
    its identity vouches for its bytes (:func:`weightcache.core.timestamps.vouches`), so
    the hash cache remembers its digest and an Acquire by file identity can match it.
    About 50 ms after a write on a nanosecond file system, 1 to 2 s on coarser ones. Files
    on tmpfs, whose identity never vouches
    (:func:`weightcache.core.timestamps.stamps_every_write`), are not waited for.

    Raises:
        TimeoutError: a file still does not qualify after ``timeout`` seconds (its
            mtime or ctime lies in the future).
    """
    files = [f for p in paths for f in ([p] if p.is_file() else sorted(p.rglob("*")))]
    deadline = time.monotonic() + timeout
    for file in files:
        if file.is_symlink() or not file.is_file():
            continue
        if not stamps_every_write(file.stat().st_dev):
            continue  # tmpfs: its identity never vouches, however long one waits
        while not vouches(*_stamps(file), time.time_ns()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{file}: its timestamps did not settle in {timeout} s")
            time.sleep(0.01)


def _stamps(file: Path) -> tuple[int, int, int]:
    info = file.stat()
    return info.st_dev, info.st_mtime_ns, info.st_ctime_ns


def raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat ``uint8`` tensor (row-major), on its device."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_bitwise_equal(
    actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]
) -> None:
    """Check the same names, and per name the same dtype, shape and bytes (NaN payloads
    included), whatever devices the tensors are on.

    Raises:
        AssertionError: naming the first tensor that differs, and how.
    """
    assert sorted(actual) == sorted(expected), (sorted(actual), sorted(expected))
    for name, want in expected.items():
        got = actual[name]
        assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != {want.dtype}"
        assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        assert torch.equal(raw_bytes(got).cpu(), raw_bytes(want).cpu()), f"{name}: bytes differ"

"""Reading safetensors checkpoints: a single file or a sharded index, treated as untrusted.

The header layout follows the safetensors specification: an unsigned little-endian 64-bit
header length N, N bytes of JSON mapping tensor names to ``{dtype, shape, data_offsets}``
(offsets relative to the byte after the header) plus an optional ``__metadata__`` of
string to string, then the data. Sharded checkpoints follow Hugging Face's
``model.safetensors.index.json``: ``weight_map`` maps each tensor name to its shard file.

Every header is validated before any tensor is read, so a malformed file fails with
:class:`InvalidCheckpointError` naming the file and the problem, never with a crash, a hang
or a silently wrong tensor.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from weightcache._dtypes import TORCH_DTYPES, itemsize
from weightcache._errors import InvalidCheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
#: Largest header accepted, in bytes (the limit safetensors itself applies).
MAX_HEADER_BYTES = 100_000_000
#: Largest index file accepted, in bytes.
MAX_INDEX_BYTES = 100_000_000
#: Most dimensions, and largest size of one, accepted: beyond them element counts and
#: strides (even of a zero-size tensor) overflow the 64-bit integers torch uses.
MAX_RANK = 16
MAX_DIM = 2**40
MAX_ELEMENTS = 2**60


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as the header describes it.

    Attributes:
        name: tensor name.
        dtype: safetensors dtype name (``"BF16"``, ``"F8_E4M3"``, ...).
        shape: sizes; ``()`` for a 0-d tensor.
        shard: file name of the shard holding it, relative to the checkpoint folder.
        begin: absolute byte offset of its data in the shard file.
        nbytes: size of its data in bytes.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    shard: str
    begin: int
    nbytes: int


@dataclass(frozen=True)
class ShardInfo:
    """One safetensors file of a checkpoint.

    Attributes:
        name: file name relative to the checkpoint folder.
        path: realpath of the file.
        size: file size in bytes.
        header_sha256: hex sha256 of the raw JSON header bytes.
        tensors: its tensors in header order.
        metadata: its ``__metadata__`` (empty when absent).
    """

    name: str
    path: Path
    size: int
    header_sha256: str
    tensors: tuple[TensorInfo, ...]
    metadata: dict[str, str]


@dataclass(frozen=True)
class Checkpoint:
    """A validated checkpoint.

    Attributes:
        root: realpath of the checkpoint folder.
        shards: its shard files, sorted by name.
        tensors: every tensor, by name, in shard then header order.
    """

    root: Path
    shards: tuple[ShardInfo, ...]
    tensors: dict[str, TensorInfo]

    @property
    def metadata(self) -> dict[str, str]:
        """``__metadata__`` of the first shard (HF writes the same one in every shard)."""
        return self.shards[0].metadata if self.shards else {}

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data, all shards together."""
        return sum(t.nbytes for t in self.tensors.values())


def hub_snapshot(cache_root: str | os.PathLike[str], repo_id: str, revision: str = "main") -> Path:
    """The snapshot folder of a Hugging Face hub cache: ``models--ORG--NAME/snapshots/REV``.

    ``revision`` is a commit hash, or a branch or tag resolved through ``refs/`` (the
    layout ``huggingface_hub`` writes; see its cache-system documentation).

    Raises:
        InvalidCheckpointError: the repository or revision is not in the cache.
    """
    repo = Path(cache_root) / ("models--" + repo_id.replace("/", "--"))
    ref = repo / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    snapshot = repo / "snapshots" / commit
    if "/" in commit or not snapshot.is_dir():
        raise InvalidCheckpointError(f"{repo_id}@{revision} is not in the hub cache {cache_root}")
    return snapshot


def open_checkpoint(
    path: str | os.PathLike[str], *, repo_id: str | None = None, revision: str = "main"
) -> Checkpoint:
    """Open and validate a checkpoint folder, or a single ``.safetensors`` file.

    A folder with ``model.safetensors.index.json`` is read as sharded: only the shards the
    index names are read (stray ``.safetensors`` files are ignored). Otherwise the folder
    must hold ``model.safetensors``. With ``repo_id``, ``path`` is a Hugging Face hub cache
    root and the snapshot of ``revision`` is opened (:func:`hub_snapshot`). Every path is
    resolved with realpath: a hub snapshot's shards are its blobs.

    Raises:
        InvalidCheckpointError: no checkpoint at ``path``; a header or index is malformed
            (length past the file or over 100 MB, invalid JSON, unknown dtype, shape and
            byte size disagreeing, offsets overlapping or past the end); a tensor name
            appears in two shards; the index names a missing shard or disagrees with it.
    """
    if repo_id is not None:
        path = hub_snapshot(path, repo_id, revision)
    root = Path(os.path.realpath(path))
    if root.is_file():
        return _assemble(root.parent, [root.name], weight_map=None)
    if not root.is_dir():
        raise InvalidCheckpointError(f"{root}: no such checkpoint folder or file")
    index = root / INDEX_FILE
    if index.is_file():
        weight_map = _read_index(index)
        return _assemble(root, sorted(set(weight_map.values())), weight_map=weight_map)
    if (root / SINGLE_FILE).is_file():
        return _assemble(root, [SINGLE_FILE], weight_map=None)
    raise InvalidCheckpointError(f"{root}: neither {SINGLE_FILE} nor {INDEX_FILE} found")


def _read_index(index: Path) -> dict[str, str]:
    if index.stat().st_size > MAX_INDEX_BYTES:
        raise InvalidCheckpointError(f"{index}: index larger than {MAX_INDEX_BYTES} bytes")
    try:
        doc = json.loads(index.read_bytes())
    except (ValueError, RecursionError) as exc:
        raise InvalidCheckpointError(f"{index}: invalid JSON: {exc}") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise InvalidCheckpointError(f"{index}: 'weight_map' must map tensor names to files")
    for shard in set(weight_map.values()):
        if "/" in shard or shard in ("", ".", ".."):
            raise InvalidCheckpointError(f"{index}: shard name {shard!r} is not a plain file name")
    return weight_map


def _assemble(root: Path, shard_names: list[str], weight_map: dict[str, str] | None) -> Checkpoint:
    shards = []
    tensors: dict[str, TensorInfo] = {}
    for name in shard_names:
        file = root / name
        if not file.is_file():
            raise InvalidCheckpointError(f"{root}: index names shard {name!r}, which is missing")
        shard = read_shard_header(file, name)
        for info in shard.tensors:
            if info.name in tensors:
                raise InvalidCheckpointError(
                    f"{root}: tensor {info.name!r} is in both {tensors[info.name].shard} and {name}"
                )
            if weight_map is not None and weight_map.get(info.name) != name:
                raise InvalidCheckpointError(
                    f"{root}: tensor {info.name!r} is in {name} but the index maps it to "
                    f"{weight_map.get(info.name)!r}"
                )
            tensors[info.name] = info
        shards.append(shard)
    if weight_map is not None:
        missing = sorted(set(weight_map) - set(tensors))
        if missing:
            raise InvalidCheckpointError(
                f"{root}: the index lists tensors absent from their shards: {missing[:5]}"
            )
    return Checkpoint(root=root, shards=tuple(shards), tensors=tensors)


def read_shard_header(file: Path, name: str) -> ShardInfo:
    """Read and validate one safetensors file's header.

    Args:
        file: path of the file.
        name: the name to report it under (relative to the checkpoint folder).

    Raises:
        InvalidCheckpointError: the header is malformed; the message says how.
    """
    real = Path(os.path.realpath(file))
    size = real.stat().st_size
    with open(real, "rb") as fh:
        prefix = fh.read(8)
        if len(prefix) < 8:
            raise InvalidCheckpointError(f"{name}: {size} bytes, shorter than a header length")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > MAX_HEADER_BYTES:
            raise InvalidCheckpointError(
                f"{name}: header length {header_len} exceeds the {MAX_HEADER_BYTES}-byte limit "
                "(is it a safetensors file?)"
            )
        if 8 + header_len > size:
            raise InvalidCheckpointError(
                f"{name}: header length {header_len} runs past the end of the {size}-byte file"
            )
        raw = fh.read(header_len)
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise InvalidCheckpointError(f"{name}: header is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise InvalidCheckpointError(f"{name}: header is not a JSON object")
    metadata = _metadata(name, header.pop("__metadata__", None))
    data_start = 8 + header_len
    tensors = [_tensor_info(name, key, entry, data_start) for key, entry in header.items()]
    _check_offsets(name, tensors, size)
    return ShardInfo(
        name=name,
        path=real,
        size=size,
        header_sha256=hashlib.sha256(raw).hexdigest(),
        tensors=tuple(tensors),
        metadata=metadata,
    )


def _metadata(shard: str, raw: object) -> dict[str, str]:
    if raw is None:
        return {}
    if not isinstance(raw, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in raw.items()
    ):
        raise InvalidCheckpointError(f"{shard}: __metadata__ must map strings to strings")
    for text in (*raw.keys(), *raw.values()):
        _check_text(shard, "__metadata__", text)
    return dict(raw)


def _check_text(shard: str, what: str, text: str) -> None:
    # JSON may escape a lone surrogate ("\ud800"), which no UTF-8 encoder (protobuf's
    # included) accepts: refuse it here rather than fail later in front of other clients.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidCheckpointError(f"{shard}: {what} is not valid Unicode") from None


def _tensor_info(shard: str, key: str, entry: object, data_start: int) -> TensorInfo:
    _check_text(shard, "a tensor name", key)
    where = f"{shard}: tensor {key!r}"
    if not isinstance(entry, dict):
        raise InvalidCheckpointError(f"{where}: entry is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in TORCH_DTYPES:
        raise InvalidCheckpointError(f"{where}: unknown dtype {dtype!r}")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_RANK
        or not all(_is_uint(d) and d <= MAX_DIM for d in shape)
        or math.prod(d for d in shape if d) > MAX_ELEMENTS
    ):
        raise InvalidCheckpointError(
            f"{where}: shape {shape!r} is not a list of at most {MAX_RANK} sizes up to {MAX_DIM}"
        )
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_uint(o) for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise InvalidCheckpointError(f"{where}: data_offsets {offsets!r} are not [begin, end]")
    nbytes = offsets[1] - offsets[0]
    expected = math.prod(shape) * itemsize(dtype)
    if nbytes != expected:
        raise InvalidCheckpointError(
            f"{where}: {nbytes} bytes of data but shape {shape} of {dtype} needs {expected}"
        )
    return TensorInfo(key, dtype, tuple(shape), shard, data_start + offsets[0], nbytes)


def _is_uint(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_offsets(shard: str, tensors: list[TensorInfo], size: int) -> None:
    end = 0
    for info in sorted(tensors, key=lambda t: (t.begin, t.nbytes)):
        if info.begin + info.nbytes > size:
            raise InvalidCheckpointError(
                f"{shard}: tensor {info.name!r} ends at byte {info.begin + info.nbytes}, "
                f"past the end of the {size}-byte file"
            )
        if info.nbytes and info.begin < end:
            raise InvalidCheckpointError(f"{shard}: tensor {info.name!r} overlaps another")
        end = max(end, info.begin + info.nbytes)


class ShardReader:
    """Reads tensors of one validated shard by offset (a context manager owning the fd).

    Raises:
        InvalidCheckpointError: on open, the file is gone or unreadable.
    """

    def __init__(self, shard: ShardInfo) -> None:
        self.shard = shard
        try:
            self._fd = os.open(shard.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise InvalidCheckpointError(f"{shard.name}: {exc.strerror}") from None

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self._fd)

    def read(self, info: TensorInfo) -> torch.Tensor:
        """A new tensor holding ``info``'s bytes, with its dtype and shape."""
        tensor = torch.empty(info.shape, dtype=TORCH_DTYPES[info.dtype])
        if info.nbytes:
            self.read_into(info, tensor.reshape(-1).view(torch.uint8).numpy().data)
        return tensor

    def read_into(self, info: TensorInfo, out: memoryview) -> None:
        """Fill ``out`` (exactly ``info.nbytes`` bytes) with the tensor's raw bytes.

        Raises:
            InvalidCheckpointError: the file ended early or a read failed.
        """
        done = 0
        while done < info.nbytes:
            try:
                n = os.preadv(self._fd, [out[done:]], info.begin + done)
            except OSError as exc:
                raise InvalidCheckpointError(f"{self.shard.name}: {exc.strerror}") from None
            if n == 0:
                raise InvalidCheckpointError(
                    f"{self.shard.name}: file ended inside tensor {info.name!r}; it changed "
                    "after it was validated"
                )
            done += n

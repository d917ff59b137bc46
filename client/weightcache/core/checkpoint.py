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

import contextlib
import errno
import hashlib
import json
import math
import os
import stat
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from weightcache.core import hub
from weightcache.core.dtypes import ITEMSIZES, SUB_BYTE, itemsize
from weightcache.core.errors import (
    InvalidCheckpointError,
    ResourceExhaustedError,
    WeightCacheError,
)
from weightcache.core.timestamps import settle, vouches

if TYPE_CHECKING:
    import torch

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
class FileIdentity:
    """What ``fstat`` says of an opened file; any change means its bytes may have changed.

    Attributes:
        dev: ``st_dev``.
        ino: ``st_ino``.
        size: ``st_size``, in bytes.
        mtime_ns: ``st_mtime_ns``, nanoseconds since the epoch (content changed).
        ctime_ns: ``st_ctime_ns``, nanoseconds since the epoch (inode changed; a
            ``utime()`` that restores the mtime still moves it).
    """

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, fd: int) -> FileIdentity:
        """The identity of an open descriptor.

        Raises:
            InvalidCheckpointError: ``fstat`` failed.
        """
        try:
            st = os.fstat(fd)
        except OSError as exc:
            raise InvalidCheckpointError(f"fstat: {exc.strerror}") from None
        return cls.of_stat(st)

    @classmethod
    def of_stat(cls, st: os.stat_result) -> FileIdentity:
        """The identity of a file as ``stat`` returned it."""
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


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
        identity: the file's identity when it was opened.
    """

    name: str
    path: Path
    size: int
    header_sha256: str
    tensors: tuple[TensorInfo, ...]
    metadata: dict[str, str]
    identity: FileIdentity


@dataclass(frozen=True)
class Checkpoint:
    """A validated checkpoint, holding its shard files open (a context manager).

    Attributes:
        root: realpath of the checkpoint folder.
        shards: its shard files, sorted by name.
        tensors: every tensor, by name, in shard then header order.
        index: the identity of ``model.safetensors.index.json`` when it was read; None
            for a single-file checkpoint.
        opened_ns: ``time.time_ns()`` before the first file was opened: every byte of the
            checkpoint was read after it (:meth:`identities_vouch`).
    """

    root: Path
    shards: tuple[ShardInfo, ...]
    tensors: dict[str, TensorInfo]
    index: FileIdentity | None = None
    opened_ns: int = 0
    _files: dict[str, int] = field(default_factory=dict, repr=False, compare=False)

    def identities_vouch(self) -> bool:
        """Whether the identities of its files (:meth:`file_identities`), found unchanged
        later, prove that the bytes read since :attr:`opened_ns` are still the files':
        each file's last change came more than its file system's timestamp granule before
        (:func:`weightcache.core.timestamps.vouches`)."""
        return all(
            vouches(i.dev, i.mtime_ns, i.ctime_ns, self.opened_ns)
            for i in self.file_identities().values()
        )

    def file_identities(self) -> dict[str, FileIdentity]:
        """Every file read, by name relative to :attr:`root`, as it was when opened: the
        shards and the index (:func:`file_identities` lists the same names)."""
        files = {shard.name: shard.identity for shard in self.shards}
        if self.index is not None:
            files[INDEX_FILE] = self.index
        return files

    def fd(self, shard: str) -> int:
        """The open descriptor of the shard named ``shard``.

        Raises:
            InvalidCheckpointError: the checkpoint is closed.
        """
        fd = self._files.get(shard)
        if fd is None:
            raise InvalidCheckpointError(f"{self.root}: {shard} is closed")
        return fd

    def check_unchanged(self) -> None:
        """Check that no shard changed since it was opened (call it after reading).

        The fingerprint and the loaded bytes both come from the opened files; a file
        rewritten in place in between would make one describe bytes the other does not
        hold.

        Raises:
            InvalidCheckpointError: a shard's dev, inode, size, mtime or ctime changed;
                the bytes read from it must not be used.
        """
        for shard in self.shards:
            if FileIdentity.of(self.fd(shard.name)) != shard.identity:
                raise InvalidCheckpointError(
                    f"{shard.name}: the file changed while it was being loaded "
                    f"({shard.path}); the bytes read are not used"
                )

    def close(self) -> None:
        """Close the shard files (idempotent); headers and metadata stay available."""
        while self._files:
            os.close(self._files.popitem()[1])

    def __del__(self) -> None:
        # A caller that never closes must not leak descriptors for the process's life.
        self.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
        InvalidCheckpointError: the repository or revision is not in the cache, or its
            ``refs/`` file is not a small regular file (:func:`weightcache.core.hub.read_ref`).
        InvalidArgumentError: the revision is malformed (``hub.check_revision``).
    """
    repo = Path(cache_root) / ("models--" + repo_id.replace("/", "--"))
    hub.check_revision(revision)
    commit = hub.read_ref(repo, revision) or revision
    snapshot = repo / "snapshots" / commit
    if "/" in commit or not snapshot.is_dir():
        raise InvalidCheckpointError(f"{repo_id}@{revision} is not in the hub cache {cache_root}")
    return snapshot


def open_checkpoint(
    path: str | os.PathLike[str],
    *,
    repo_id: str | None = None,
    revision: str = "main",
    check_file: Callable[[Path], None] | None = None,
) -> Checkpoint:
    """Open and validate a checkpoint folder, or a single ``.safetensors`` file.

    A folder with ``model.safetensors.index.json`` is read as sharded: only the shards the
    index names are read (stray ``.safetensors`` files are ignored). Otherwise the folder
    must hold ``model.safetensors``. With ``repo_id``, ``path`` is a Hugging Face hub cache
    root and the snapshot of ``revision`` is opened (:func:`hub_snapshot`).

    Every file is opened once, relative to the opened folder, and everything afterwards
    (validation, fingerprint, data) reads that descriptor: a file renamed or replaced by
    a symlink later is never read. Symlinks are followed at open (a hub snapshot's shards
    are its blobs); ``ShardInfo.path`` is where the opened file really is. The returned
    checkpoint holds the descriptors until :meth:`Checkpoint.close` (or ``with``).

    Args:
        check_file: called with the real path of every file right after it is opened,
            before any byte of it is read; it raises to refuse the file (the daemon's
            ``--model-root`` confinement).

    Raises:
        InvalidCheckpointError: no checkpoint at ``path``; a file is not a regular file;
            a header or index is malformed (length past the file or over 100 MB, invalid
            JSON or UTF-8, a duplicate key, unknown or sub-byte dtype, shape and byte size
            disagreeing, offsets overlapping, leaving a gap or trailing bytes, or past the
            end); a tensor name appears in two shards; the index maps no tensor, names a
            missing shard or disagrees with it.
        Exception: whatever ``check_file`` raises.
    """
    if repo_id is not None:
        path = hub_snapshot(path, repo_id, revision)
    opened_ns = time.time_ns()  # before any byte is read (Checkpoint.identities_vouch)
    files: dict[str, int] = {}
    try:
        try:
            fd = _open(os.fspath(path), None, str(path))
        except FileNotFoundError:
            raise InvalidCheckpointError(f"{path}: no such checkpoint folder or file") from None
        real = _real_path(fd, os.fspath(path))
        if stat.S_ISREG(os.fstat(fd).st_mode):
            files[real.name] = fd
            if check_file is not None:
                check_file(real)
            settle(fd)
            return _assemble(real.parent, files, weight_map=None, opened_ns=opened_ns)
        try:
            return _open_folder(fd, real, files, check_file, opened_ns)
        finally:
            os.close(fd)
    except BaseException:
        for fd in files.values():
            os.close(fd)
        raise


#: Most files :func:`file_identities` lists; a folder holding more is not matched by them.
MAX_FILES = 4096


def file_identities(path: str | os.PathLike[str]) -> tuple[Path, dict[str, FileIdentity]] | None:
    """The checkpoint files at ``path`` and their identities, without reading any of them.

    For a folder: ``model.safetensors.index.json`` and every ``*.safetensors`` file in it
    (so a superset of the shards the index names); for a single file: that file. Symlinks
    are followed (a hub snapshot's shards are its blobs), as :func:`open_checkpoint` does.
    It is what a worker sends to be matched with the very files a daemon loaded
    (:meth:`Checkpoint.file_identities`): no parsing, one ``stat`` per file.

    Returns:
        The real path of the folder and ``{file name: identity}``; None when ``path``
        cannot be opened, is neither a folder nor a regular file, or holds more than
        :data:`MAX_FILES` such files (:func:`open_checkpoint` then says what is wrong).
    """
    try:
        fd = _open(os.fspath(path), None, str(path))
    except (OSError, InvalidCheckpointError):
        return None
    try:
        st = os.fstat(fd)
        real = _real_path(fd, os.fspath(path))
        if stat.S_ISREG(st.st_mode):
            return real.parent, {real.name: FileIdentity.of_stat(st)}
        if not stat.S_ISDIR(st.st_mode):
            return None
        names = [n for n in os.listdir(fd) if n.endswith(".safetensors") or n == INDEX_FILE]
        if len(names) > MAX_FILES:
            return None
        return real, _stat_all(fd, sorted(names))
    except OSError:
        return None
    finally:
        os.close(fd)


def _stat_all(folder: int, names: list[str]) -> dict[str, FileIdentity]:
    files = {}
    for name in names:
        with contextlib.suppress(OSError):  # vanished or unreadable: simply not matched
            st = os.stat(name, dir_fd=folder)
            if stat.S_ISREG(st.st_mode):
                files[name] = FileIdentity.of_stat(st)
    return files


def _open_folder(
    folder: int,
    root: Path,
    files: dict[str, int],
    check_file: Callable[[Path], None] | None,
    opened_ns: int,
) -> Checkpoint:
    if not stat.S_ISDIR(os.fstat(folder).st_mode):
        raise InvalidCheckpointError(f"{root}: neither a folder nor a regular file")
    weight_map = index_identity = None
    names = [SINGLE_FILE]
    index = _open_file(folder, root, INDEX_FILE, check_file, missing_ok=True)
    if index is not None:
        try:
            index_identity = FileIdentity.of(index)
            weight_map = _read_index(index, root / INDEX_FILE)
        finally:
            os.close(index)
        names = sorted(set(weight_map.values()))
    for name in names:
        fd = _open_file(folder, root, name, check_file, missing_ok=weight_map is None)
        if fd is None:
            raise InvalidCheckpointError(
                f"{root}: neither {SINGLE_FILE} nor {INDEX_FILE} found{_pickled_hint(folder)}"
            )
        files[name] = fd
    return _assemble(root, files, weight_map=weight_map, index=index_identity, opened_ns=opened_ns)


#: File name endings of PyTorch's pickled weights, which are never read here (unpickling
#: runs code).
PICKLED_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


def _pickled_hint(folder: int) -> str:
    """``; it holds pickled weights (NAMES), ...`` when the folder holds files of
    :data:`PICKLED_SUFFIXES` (at most 5 named), else ``""`` (issue 37, item 18: the
    error did not say why a folder of ``.bin`` files was refused)."""
    try:
        names = sorted(n for n in os.listdir(folder) if n.endswith(PICKLED_SUFFIXES))
    except OSError:
        return ""
    if not names:
        return ""
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return (
        f"; it holds pickled PyTorch weights ({shown}), which are not read (unpickling runs "
        "code): save them as safetensors first (transformers: "
        "save_pretrained(..., safe_serialization=True))"
    )


def _open(path: str, folder: int | None, shown: str) -> int:
    # O_NONBLOCK: opening a FIFO planted as a shard must not hang; it is refused below.
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY
    try:
        fd = os.open(path, flags, dir_fd=folder)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise open_error(shown, exc) from None
    os.set_blocking(fd, True)
    return fd


#: errno values that say the process or the system ran out of something, not that the file
#: is bad: reported as RESOURCE_EXHAUSTED, never INVALID_CHECKPOINT.
RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM})


def open_error(shown: str, exc: OSError) -> WeightCacheError:
    """The error for a file that could not be opened: :class:`ResourceExhaustedError` when
    the process or system is out of file descriptors or memory (``EMFILE``, ``ENFILE``,
    ``ENOMEM``), else :class:`InvalidCheckpointError`; both name the file."""
    if exc.errno in RESOURCE_ERRNOS:
        return ResourceExhaustedError(f"cannot open {shown}: {exc.strerror} (errno {exc.errno})")
    return InvalidCheckpointError(f"{shown}: {exc.strerror}")


def _open_file(
    folder: int,
    root: Path,
    name: str,
    check_file: Callable[[Path], None] | None,
    *,
    missing_ok: bool,
) -> int | None:
    try:
        fd = _open(name, folder, name)
    except FileNotFoundError:
        if missing_ok:
            return None
        raise InvalidCheckpointError(
            f"{root}: index names shard {name!r}, which is missing"
        ) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise InvalidCheckpointError(f"{root}: {name} is not a regular file")
        if check_file is not None:
            check_file(_real_path(fd, os.path.join(root, name)))
        settle(fd)  # before any byte is read: see weightcache.core.timestamps
    except BaseException:
        os.close(fd)
        raise
    return fd


def _real_path(fd: int, fallback: str) -> Path:
    """Where the opened file is: /proc's link names what was opened, not what a path
    names now."""
    try:
        return Path(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        return Path(os.path.realpath(fallback))


def _read_at(fd: int, offset: int, length: int, name: str) -> bytes:
    chunks = []
    while length:
        try:
            chunk = os.pread(fd, length, offset)
        except OSError as exc:
            raise InvalidCheckpointError(f"{name}: {exc.strerror}") from None
        if not chunk:
            raise InvalidCheckpointError(f"{name}: file ended early; it changed while read")
        chunks.append(chunk)
        offset += len(chunk)
        length -= len(chunk)
    return b"".join(chunks)


class _DuplicateKeyError(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json keeps the last of duplicate keys silently; safetensors (serde) refuses them.
    # dict() in C, once per JSON object; the loop only to name a duplicate.
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKeyError(key)
            seen.add(key)
    return out


def _parse_json(raw: bytes, where: str) -> object:
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
    except _DuplicateKeyError as exc:
        raise InvalidCheckpointError(f"{where} names {exc.args[0]!r} twice") from None
    except UnicodeDecodeError:
        raise InvalidCheckpointError(f"{where} is not valid UTF-8") from None
    except (ValueError, RecursionError) as exc:
        raise InvalidCheckpointError(f"{where} is not valid JSON: {exc}") from None


def _read_index(fd: int, index: Path) -> dict[str, str]:
    size = os.fstat(fd).st_size
    if size > MAX_INDEX_BYTES:
        raise InvalidCheckpointError(f"{index}: index larger than {MAX_INDEX_BYTES} bytes")
    doc = _parse_json(_read_at(fd, 0, size, str(index)), str(index))
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise InvalidCheckpointError(f"{index}: 'weight_map' must map tensor names to files")
    if not weight_map:
        raise InvalidCheckpointError(f"{index}: 'weight_map' maps no tensor")
    for shard in set(weight_map.values()):
        if "/" in shard or shard in ("", ".", ".."):
            raise InvalidCheckpointError(f"{index}: shard name {shard!r} is not a plain file name")
    return weight_map


def _assemble(
    root: Path,
    files: dict[str, int],
    weight_map: dict[str, str] | None,
    index: FileIdentity | None = None,
    opened_ns: int = 0,
) -> Checkpoint:
    shards = []
    tensors: dict[str, TensorInfo] = {}
    for name, fd in files.items():
        shard = read_shard_header(fd, name, _real_path(fd, os.path.join(root, name)))
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
    return Checkpoint(
        root=root,
        shards=tuple(shards),
        tensors=tensors,
        index=index,
        opened_ns=opened_ns,
        _files=files,
    )


def read_shard_header(fd: int, name: str, path: Path) -> ShardInfo:
    """Read and validate one safetensors file's header from an open descriptor.

    Args:
        fd: the opened file (not closed here).
        name: the name to report it under (relative to the checkpoint folder).
        path: where the opened file really is.

    Raises:
        InvalidCheckpointError: the header is malformed; the message says how.
    """
    identity = FileIdentity.of(fd)
    size = identity.size
    if size < 8:
        raise InvalidCheckpointError(f"{name}: {size} bytes, shorter than a header length")
    (header_len,) = struct.unpack("<Q", _read_at(fd, 0, 8, name))
    if header_len > MAX_HEADER_BYTES:
        raise InvalidCheckpointError(
            f"{name}: header length {header_len} exceeds the {MAX_HEADER_BYTES}-byte limit "
            "(is it a safetensors file?)"
        )
    if 8 + header_len > size:
        raise InvalidCheckpointError(
            f"{name}: header length {header_len} runs past the end of the {size}-byte file"
        )
    raw = _read_at(fd, 8, header_len, name)
    header = _parse_json(raw, f"{name}: header")
    if not isinstance(header, dict):
        raise InvalidCheckpointError(f"{name}: header is not a JSON object")
    metadata = _metadata(name, header.pop("__metadata__", None))
    data_start = 8 + header_len
    tensors = [_tensor_info(name, key, entry, data_start) for key, entry in header.items()]
    _check_coverage(name, tensors, data_start, size)
    return ShardInfo(
        name=name,
        path=path,
        size=size,
        header_sha256=hashlib.sha256(raw).hexdigest(),
        tensors=tuple(tensors),
        metadata=metadata,
        identity=identity,
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


#: safetensors dtype name -> bytes per element, for the header's byte-size check.
_ITEMSIZE = ITEMSIZES


def _tensor_info(shard: str, key: str, entry: object, data_start: int) -> TensorInfo:
    """One header entry, checked. Called once per tensor: the checks are written out
    (no generator, no message built) for the common case of a valid entry, and only a
    failing entry goes on to :func:`_entry_error` for its message."""
    _check_text(shard, "a tensor name", key)
    if not isinstance(entry, dict):
        raise _entry_error(shard, key, entry)
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or type(shape) is not list or len(shape) > MAX_RANK:
        raise _entry_error(shard, key, entry)
    item = _ITEMSIZE.get(dtype)
    if item is None:
        raise _entry_error(shard, key, entry)
    nonzero, empty = 1, False
    for size in shape:
        # type() is int: json makes no int subclass, and bool (a subclass) is refused.
        if type(size) is not int or not 0 <= size <= MAX_DIM:
            raise _entry_error(shard, key, entry)
        if size:
            nonzero *= size
        else:
            empty = True
    if nonzero > MAX_ELEMENTS or type(offsets) is not list or len(offsets) != 2:
        raise _entry_error(shard, key, entry)
    begin, end = offsets
    if type(begin) is not int or type(end) is not int or not 0 <= begin <= end:
        raise _entry_error(shard, key, entry)
    if end - begin != (0 if empty else nonzero * item):
        raise _entry_error(shard, key, entry)
    return TensorInfo(key, dtype, tuple(shape), shard, data_start + begin, end - begin)


def _entry_error(shard: str, key: str, entry: object) -> InvalidCheckpointError:
    """What is wrong with a header entry :func:`_tensor_info` refused, checked in the
    order the messages are documented."""
    where = f"{shard}: tensor {key!r}"
    if not isinstance(entry, dict):
        return InvalidCheckpointError(f"{where}: entry is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if isinstance(dtype, str) and dtype in SUB_BYTE:
        return InvalidCheckpointError(
            f"{where}: dtype {dtype} packs elements below a byte; weightcache does not support it"
        )
    if not isinstance(dtype, str) or dtype not in ITEMSIZES:
        return InvalidCheckpointError(f"{where}: unknown dtype {dtype!r}")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_RANK
        or not all(_is_uint(d) and d <= MAX_DIM for d in shape)
        or math.prod(d for d in shape if d) > MAX_ELEMENTS
    ):
        return InvalidCheckpointError(
            f"{where}: shape {shape!r} is not a list of at most {MAX_RANK} sizes up to {MAX_DIM}"
        )
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_uint(o) for o in offsets)
        or offsets[0] > offsets[1]
    ):
        return InvalidCheckpointError(f"{where}: data_offsets {offsets!r} are not [begin, end]")
    nbytes = offsets[1] - offsets[0]
    expected = math.prod(shape) * itemsize(dtype)
    return InvalidCheckpointError(
        f"{where}: {nbytes} bytes of data but shape {shape} of {dtype} needs {expected}"
    )


def _is_uint(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_coverage(shard: str, tensors: list[TensorInfo], data_start: int, size: int) -> None:
    """Tensors must tile the data exactly: sorted by offsets, each begins where the previous
    one ended, and the last ends at the end of the file; no overlap, gap or trailing byte.

    These are the rules of the reference reader (safetensors ``Metadata::validate``:
    ``InvalidOffset`` and ``MetadataIncompleteBuffer``; safetensors README, "Format").
    """
    cursor = data_start
    for info in sorted(tensors, key=lambda t: (t.begin, t.begin + t.nbytes)):
        end = info.begin + info.nbytes
        if end > size:
            raise InvalidCheckpointError(
                f"{shard}: tensor {info.name!r} ends at byte {end}, "
                f"past the end of the {size}-byte file"
            )
        if info.begin < cursor:
            raise InvalidCheckpointError(f"{shard}: tensor {info.name!r} overlaps another")
        if info.begin > cursor:
            raise InvalidCheckpointError(
                f"{shard}: {info.begin - cursor} bytes of no tensor before tensor {info.name!r}"
            )
        cursor = end
    if cursor != size:
        raise InvalidCheckpointError(
            f"{shard}: {size - cursor} trailing bytes after the last tensor"
        )


class ShardReader:
    """Reads tensors of one validated shard by offset, from its open descriptor.

    Args:
        shard: the shard.
        fd: its descriptor, opened by :func:`open_checkpoint` (not closed here).
    """

    def __init__(self, shard: ShardInfo, fd: int) -> None:
        self.shard = shard
        self._fd = fd

    def read(self, info: TensorInfo) -> torch.Tensor:
        """A new tensor holding ``info``'s bytes, with its dtype and shape (imports torch:
        only a recipe that computes from the stored tensors reads them this way)."""
        import torch

        from weightcache.core.dtypes import TORCH_DTYPES

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

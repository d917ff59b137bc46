"""Opening a daemon's storage handle and building torch tensors that view it.

A ``SharedMemoryHandle`` is mapped ``MAP_PRIVATE`` (Python's ``mmap.ACCESS_COPY``): pages
are shared with the daemon and every other worker until this process writes one, which
then becomes a private copy. A worker that writes to its weights never changes anyone
else's (mmap(2), "MAP_PRIVATE: copy-on-write mapping").

A ``CudaIpcHandle`` is opened with ``cudaIpcOpenMemHandle`` on the local device whose UUID
matches (:mod:`weightcache.core.cuda`); the views are device tensors over that mapping.

On CPU the tensors are built in one call by the compiled ``weightcache._views``
(client/csrc/views.cpp, built by ``make setup``), about three times faster per tensor than
``torch.as_strided`` from Python; without it, or on a device, one ``torch.as_strided`` per
tensor. Both check the same things and give the same sizes, strides and bytes.
"""

from __future__ import annotations

import errno
import mmap
import operator
import os
import stat
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from types import ModuleType

import torch

from weightcache.core.cuda import local_index, open_ipc
from weightcache.core.dtypes import TORCH_DTYPES
from weightcache.core.errors import HandleError, ResourceExhaustedError, WeightCacheError
from weightcache.core.records import CudaIpcHandle, SharedMemoryHandle, ViewColumns, ViewRow
from weightcache.core.sockets import SHM_DIR


def _compiled() -> ModuleType | None:
    try:
        from weightcache import _views
    except ImportError:  # not built (make setup builds it): torch.as_strided per tensor
        return None
    return _views


_NATIVE = _compiled()


@dataclass
class MappedArena:
    """A mapped arena and the tensors viewing it.

    Attributes:
        tensors: name -> tensor, each over ``base``'s storage (tied names share bytes).
        base: the whole arena as a 1-D ``uint8`` tensor.
        size: arena size in bytes.
    """

    tensors: dict[str, torch.Tensor]
    base: torch.Tensor
    size: int
    # id -> weak reference, not a WeakSet: a WeakSet compares two references to one tensor
    # with Tensor.__eq__ (elementwise), so tracking a tensor twice raised RuntimeError.
    _tracked: dict[int, weakref.ref[torch.Tensor]] = field(default_factory=dict)
    _on_device: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        # A CPU arena is privatized under its views without re-pointing any: nothing to
        # track (a weak reference per tensor cost about 1 µs of each attach).
        self._on_device = self.base.device.type != "cpu"
        for tensor in self.tensors.values() if self._on_device else ():
            self.track(tensor)

    def track(self, tensor: torch.Tensor) -> None:
        """Also re-point ``tensor`` (a view of the arena, e.g. an ``nn.Parameter`` made
        from one) when the arena is privatized on a device (nothing to do on CPU)."""
        if self._on_device:
            self._tracked[id(tensor)] = weakref.ref(tensor)

    def privatize(self) -> None:
        """Give this process its own copy of the arena, under every existing view.

        CPU: writing a page of a ``MAP_PRIVATE`` mapping makes the kernel copy it into
        memory private to this process (mmap(2)); writing each page's first byte back
        unchanged does that for all pages without changing a value or an address.

        CUDA: one device-to-device copy of the arena, then every tracked tensor is
        re-pointed (``Tensor.set_``) at the same offset of the copy; the IPC mapping closes
        when the last view of it is gone.

        Either way the daemon can then free its memory without this process noticing.
        """
        if self.base.device.type == "cpu":
            pages = self.base[:: mmap.PAGESIZE]
            pages.copy_(pages.clone())
            return
        storage = self.base.clone().untyped_storage()
        # The copy runs asynchronously: it must be done before the mapping can close and
        # before the lease is released (the daemon may then free the arena).
        torch.cuda.synchronize(self.base.device)
        with torch.no_grad():
            for tensor in [ref() for ref in list(self._tracked.values())]:
                if tensor is None:
                    continue
                tensor.set_(storage, tensor.storage_offset(), tensor.shape, tensor.stride())
        self.base = torch.empty(0, dtype=torch.uint8, device=self.base.device).set_(storage)


def open_shared_memory(
    handle: SharedMemoryHandle,
    views: ViewColumns,
    *,
    copy: bool,
    owner: int | None = None,
) -> MappedArena:
    """Map a shared-memory arena and build one tensor per view.

    The segment is opened once (``O_NOFOLLOW``) and everything is checked on that
    descriptor: owner, type, and its size, which must be the handle's both before it is
    mapped and again once it is, before any view is built (a segment the daemon truncated
    under the mapping is refused here, instead of ``SIGBUS`` on a later read). After this
    returns, a zero-copy attach's bytes are the owner's file: see SECURITY.md, "Not
    protected".

    Args:
        handle: the arena's path and size in bytes.
        views: tensor views of the arena.
        copy: read the whole arena through the descriptor into private memory (tied
            views stay tied); no mapping of the segment is kept, and a segment that
            shrinks while it is read is refused rather than faulting.
        owner: uid the segment must belong to (the daemon's); None skips the check.

    Raises:
        HandleError: the path holds a NUL byte or is not a file directly under /dev/shm,
            is a symlink, is not a regular file, belongs to another uid than ``owner``,
            its size differs from the handle's (before mapping, after mapping, or while
            copied), or a view lies outside the arena or has an unknown dtype.
        ResourceExhaustedError: this process, or the system, has no file descriptor
            (``EMFILE``, ``ENFILE``) or memory (``ENOMEM``, or no room for the copy) to
            open, map or copy the segment.
    """
    _check_path(handle.path)
    fd = _open_regular(handle.path)
    try:
        info = os.fstat(fd)
        if owner is not None and info.st_uid != owner:
            raise HandleError(f"{handle.path}: owned by uid {info.st_uid}, not the daemon's")
        size = info.st_size
        if size != handle.size or size <= 0:
            raise HandleError(f"{handle.path}: size {size} does not match handle {handle.size}")
        if copy:
            base = torch.frombuffer(_read_all(fd, handle.path, size), dtype=torch.uint8)
        else:
            try:
                mapping = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
            except OSError as exc:
                raise _os_error(handle.path, "map", exc) from None
            _check_size(fd, handle.path, size, "once mapped")
            base = torch.frombuffer(mapping, dtype=torch.uint8)
    finally:
        os.close(fd)
    return MappedArena(tensors=build_views(base, views), base=base, size=size)


#: errno values that say this process or the system ran out of something (descriptors,
#: memory), not that the handle is bad: ``RESOURCE_EXHAUSTED``.
EXHAUSTED_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM})


def _os_error(path: str, doing: str, exc: OSError) -> WeightCacheError:
    """The documented reason for an ``OSError`` of opening, mapping or reading a segment."""
    detail = f"{path}: cannot {doing} shared memory: {exc.strerror}"
    if exc.errno in EXHAUSTED_ERRNOS:
        return ResourceExhaustedError(f"{detail} (in this worker process)")
    return HandleError(detail)


def _check_size(fd: int, path: str, size: int, when: str) -> None:
    """Refuse a segment whose size is no longer ``size`` (bytes)."""
    now = os.fstat(fd).st_size
    if now != size:
        raise HandleError(f"{path}: size {now} does not match handle {size} ({when})")


def _read_all(fd: int, path: str, size: int) -> mmap.mmap:
    """Read ``size`` bytes of the segment through ``fd`` into private anonymous memory.

    Raises:
        HandleError: the segment ended early (it shrank) or a read failed.
        ResourceExhaustedError: no memory for the copy.
    """
    try:
        buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as exc:
        raise _os_error(path, "copy", exc) from None
    view = memoryview(buffer)
    done = 0
    try:
        while done < size:
            try:
                got = os.preadv(fd, [view[done:]], done)
            except OSError as exc:
                raise _os_error(path, "read", exc) from None
            if got == 0:
                raise HandleError(
                    f"{path}: size {done} does not match handle {size} (shrank while copied)"
                )
            done += got
        _check_size(fd, path, size, "once copied")
    finally:
        view.release()
    return buffer


def open_cuda_ipc(handle: CudaIpcHandle, views: ViewColumns, *, copy: bool) -> MappedArena:
    """Open a CUDA IPC arena on the local device with the handle's UUID.

    Args:
        handle: device UUID, 64-byte IPC handle, size in bytes.
        views: tensor views of the arena.
        copy: copy the arena device-to-device into this process's own memory; the IPC
            mapping closes once the temporary view of it is gone.

    Raises:
        DeviceNotVisibleError: this process cannot see the device.
        CudaError: the runtime refuses the handle.
        HandleError: a view does not fit the arena.
    """
    index = local_index(handle.device_uuid)
    base = open_ipc(handle.ipc_handle, handle.size, index)
    if copy:
        private = base.clone()
        # The copy runs asynchronously: it must be done before the last view of the mapping
        # goes (that closes it) and before the caller releases the lease.
        torch.cuda.synchronize(index)
        base = private
    return MappedArena(tensors=build_views(base, views), base=base, size=handle.size)


def _check_path(path: str) -> None:
    if "\0" in path:
        raise HandleError(f"{path!r}: a shared-memory handle's path holds a NUL byte")
    if os.path.dirname(path) != SHM_DIR or os.path.basename(path) in ("", ".", ".."):
        raise HandleError(f"{path}: shared-memory handles must name a file in {SHM_DIR}")


class SegmentGoneError(HandleError):
    """The segment a grant named is no longer in /dev/shm: the daemon unlinked it (the
    model was evicted or revoked) between the grant and this process opening it. The
    caller may ask again: the daemon's next answer says what happened."""


def _open_regular(path: str) -> int:
    try:
        # O_NONBLOCK: opening a FIFO planted at the path must not block; the type is
        # checked right after.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise SegmentGoneError(f"{path}: the segment was removed after the grant") from None
    except OSError as exc:
        raise _os_error(path, "open", exc) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise HandleError(f"{path}: not a regular file")
    return fd


def build_views(base: torch.Tensor, views: ViewColumns) -> dict[str, torch.Tensor]:
    """Build one tensor per view of a 1-D ``uint8`` tensor holding the arena.

    The bounds are torch's: ``torch.as_strided`` refuses a view that reaches past its
    storage (``checkInBoundsForStorage``) or holds more than 2**63 - 1 elements
    (``weightcache._views`` checks the same, in C++). Checked here, before torch: a stride
    list of the shape's length and no negative size or stride (torch lets a negative size
    by beside a zero one). Checked here, as torch does not: a byte offset aligned to the
    dtype and, for an empty view, inside the arena; and the byte length the daemon sent
    (``nbytes``, when not 0: a daemon and a client that disagree on a dtype's size would
    read other bytes than the daemon wrote).

    The views are built column by column: on CPU by ``weightcache._views`` in one call
    (the same checks, in C++), else by :func:`_bulk_views` (one ``torch.as_strided`` per
    tensor and nothing else per tensor at the Python level, the checks done over whole
    columns). Only when a check fails are the views built again one by one
    (:func:`_checked_views`), to name the tensor at fault.

    Raises:
        HandleError: a view has an unknown dtype, a misaligned offset, a stride list of the
            wrong length, a negative size or stride, reaches past the end of the arena, or
            has a non-zero ``nbytes`` other than its elements times its dtype's size.
    """
    try:
        compiled = _compiled_views(base, views)
        if compiled is not None:
            return dict(zip(views.names, compiled, strict=True))
        built = _bulk_views(base, views)
    except (KeyError, RuntimeError, ValueError, TypeError, OverflowError):
        built = None  # a view torch refuses, or an unknown dtype: named below
    return _checked_views(base, views.rows()) if built is None else built


def _bulk_views(base: torch.Tensor, views: ViewColumns) -> dict[str, torch.Tensor] | None:
    """The views, or None when a column-wide check fails.

    Raises:
        KeyError: a dtype is unknown.
        RuntimeError, ValueError, TypeError, OverflowError: torch refuses a view.
    """
    size = base.numel()
    if not views.names:
        return {}
    dtypes = [TORCH_DTYPES[dtype] for dtype in views.dtypes]
    items = [dtype.itemsize for dtype in dtypes]
    offsets = views.byte_offsets
    if min(offsets) < 0 or max(offsets) > size or any(map(operator.mod, offsets, items)):
        return None
    # torch.as_strided takes a negative size beside a zero one (an "empty" view).
    if min(views.shape, default=0) < 0 or min(views.stride, default=0) < 0:
        return None
    # Generators, not lists: each tensor's sizes and strides are made, used and freed in
    # turn (a list of them all took fresh memory, whose page faults cost more than them).
    cuts = list(views.cuts())
    built = _strided(
        base,
        dtypes,
        map(views.shape.__getitem__, cuts),
        map(views.stride.__getitem__, cuts),
        map(operator.floordiv, offsets, items),
    )
    got = list(map(_NBYTES, built))
    if got != views.nbytes and any(n and g != n for g, n in zip(got, views.nbytes, strict=True)):
        return None
    return dict(zip(views.names, built, strict=True))


_NBYTES = operator.attrgetter("nbytes")


def _compiled_views(base: torch.Tensor, views: ViewColumns) -> list[torch.Tensor] | None:
    """The views built by ``weightcache._views`` (client/csrc/views.cpp), in order; None
    where it is not built or ``base`` is not on CPU. They are not autograd views of the
    arena (no ``_base``), but share its version counter as its views do.

    Raises:
        KeyError: a dtype is unknown.
        ValueError: a view fails a check (:func:`build_views` lists them).
    """
    if _NATIVE is None or base.device.type != "cpu":
        return None
    if not views.names:
        return []
    typed = {dtype: _typed(base, TORCH_DTYPES[dtype]) for dtype in dict.fromkeys(views.dtypes)}
    index = {dtype: i for i, dtype in enumerate(typed)}
    built: list[torch.Tensor] = _NATIVE.views(
        list(typed.values()),
        list(map(index.__getitem__, views.dtypes)),
        views.ranks,
        views.shape,
        views.stride,
        views.byte_offsets,
        views.nbytes,
        base.numel(),
    )
    return built


def _strided(
    base: torch.Tensor,
    dtypes: Sequence[torch.dtype],
    shapes: Iterable[Sequence[int]],
    strides: Iterable[Sequence[int]],
    offsets: Iterable[int],
) -> list[torch.Tensor]:
    """One ``torch.as_strided`` per tensor over the arena viewed as its dtype (offsets in
    elements of it); nothing checked beyond what torch checks.

    Raises:
        RuntimeError, ValueError, TypeError, OverflowError: torch refuses a view.
    """
    typed = {dtype: _typed(base, dtype) for dtype in set(dtypes)}
    return list(map(torch.as_strided, map(typed.__getitem__, dtypes), shapes, strides, offsets))


def _checked_views(base: torch.Tensor, views: Iterable[ViewRow]) -> dict[str, torch.Tensor]:
    """The views built and checked one at a time: the first one at fault is named.

    Raises:
        HandleError: as :func:`build_views`.
    """
    typed: dict[str, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    size = base.numel()
    for row in views:
        name, dtype, shape, stride, offset, nbytes = row
        if dtype not in TORCH_DTYPES:
            raise HandleError(f"tensor {name!r}: unknown dtype {dtype!r}")
        if dtype not in typed:
            typed[dtype] = _typed(base, TORCH_DTYPES[dtype])
        arena, item = typed[dtype], TORCH_DTYPES[dtype].itemsize
        if len(stride) != len(shape) or min((*shape, *stride), default=0) < 0:
            raise HandleError(f"tensor {name!r}: shape {shape} and stride {stride} disagree")
        if offset % item:
            raise HandleError(f"tensor {name!r}: misaligned byte_offset {offset}")
        if not 0 <= offset <= size:
            raise HandleError(f"tensor {name!r}: reaches past the {size}-byte arena")
        try:
            out[name] = view = torch.as_strided(arena, shape, stride, offset // item)
        except (RuntimeError, ValueError, TypeError, OverflowError) as exc:
            raise _view_error(row, size, exc) from None
        if nbytes and view.nbytes != nbytes:
            raise HandleError(
                f"tensor {name!r}: nbytes {nbytes} is not its shape {shape} times the "
                f"{item}-byte size of {dtype}"
            )
    return out


def _typed(base: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The arena viewed as ``dtype`` (its whole elements)."""
    return base[: base.numel() - base.numel() % dtype.itemsize].view(dtype)


def _view_error(row: ViewRow, size: int, exc: Exception) -> HandleError:
    name = row[0]
    if "out of bounds" in str(exc):
        return HandleError(f"tensor {name!r}: reaches past the {size}-byte arena")
    return HandleError(f"tensor {name!r}: cannot be viewed: {exc}")

"""Opening a daemon's storage handle and building torch tensors that view it.

A ``SharedMemoryHandle`` is mapped ``MAP_PRIVATE`` (Python's ``mmap.ACCESS_COPY``): pages
are shared with the daemon and every other worker until this process writes one, which
then becomes a private copy. A worker that writes to its weights never changes anyone
else's (mmap(2), "MAP_PRIVATE: copy-on-write mapping").

A ``CudaIpcHandle`` is opened with ``cudaIpcOpenMemHandle`` on the local device whose UUID
matches (:mod:`weightcache.core.cuda`); the views are device tensors over that mapping.
"""

from __future__ import annotations

import math
import mmap
import os
import stat
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from weightcache.core.cuda import local_index, open_ipc
from weightcache.core.dtypes import TORCH_DTYPES
from weightcache.core.errors import HandleError
from weightcache.core.records import CudaIpcHandle, SharedMemoryHandle
from weightcache.core.sockets import SHM_DIR


class View(Protocol):
    """What :func:`build_views` reads of one tensor view: a
    :class:`weightcache.core.records.TensorView`, or the wire's ``TensorView`` message
    itself. The attach path hands over the reply's messages as they are: decoding tens of
    thousands of them into records first cost about 3 µs each, for the same five fields."""

    @property
    def name(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> Sequence[int]: ...
    @property
    def stride(self) -> Sequence[int]: ...
    @property
    def byte_offset(self) -> int: ...


@dataclass
class MappedArena:
    """A mapped arena and the tensors viewing it.

    Attributes:
        tensors: name -> tensor, each a view of ``base`` (tied names share bytes).
        base: the whole arena as a 1-D ``uint8`` tensor.
        size: arena size in bytes.
    """

    tensors: dict[str, torch.Tensor]
    base: torch.Tensor
    size: int
    # id -> weak reference, not a WeakSet: a WeakSet compares two references to one tensor
    # with Tensor.__eq__ (elementwise), so tracking a tensor twice raised RuntimeError.
    _tracked: dict[int, weakref.ref[torch.Tensor]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for tensor in self.tensors.values():
            self.track(tensor)

    def track(self, tensor: torch.Tensor) -> None:
        """Also re-point ``tensor`` (a view of the arena, e.g. an ``nn.Parameter`` made
        from one) when the arena is privatized on a device."""
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
    views: Sequence[View],
    *,
    copy: bool,
    owner: int | None = None,
) -> MappedArena:
    """Map a shared-memory arena and build one tensor per view.

    Args:
        handle: the arena's path and size in bytes.
        views: tensor views of the arena.
        copy: copy the whole arena into private memory first (one memcpy, tied views stay
            tied); the mapping is closed before returning.
        owner: uid the segment must belong to (the daemon's); None skips the check.

    Raises:
        HandleError: the path is not a regular file directly under /dev/shm, is a symlink,
            belongs to another uid than ``owner``, its size differs from the handle's, or a
            view lies outside the arena or has an unknown dtype.
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
        mapping = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    base = torch.frombuffer(mapping, dtype=torch.uint8)
    if copy:
        base = base.clone()
        # The clone owns its bytes; the mapping can go now that no tensor views it.
        del mapping
    return MappedArena(tensors=build_views(base, views), base=base, size=size)


def open_cuda_ipc(handle: CudaIpcHandle, views: Sequence[View], *, copy: bool) -> MappedArena:
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
    if os.path.dirname(path) != SHM_DIR or os.path.basename(path) in ("", ".", ".."):
        raise HandleError(f"{path}: shared-memory handles must name a file in {SHM_DIR}")


def _open_regular(path: str) -> int:
    try:
        # O_NONBLOCK: opening a FIFO planted at the path must not block; the type is
        # checked right after.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise HandleError(f"{path}: cannot open shared memory: {exc.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise HandleError(f"{path}: not a regular file")
    return fd


def build_views(base: torch.Tensor, views: Sequence[View]) -> dict[str, torch.Tensor]:
    """Build one tensor per view of a 1-D ``uint8`` tensor holding the arena.

    Raises:
        HandleError: a view has an unknown dtype, a misaligned offset, a stride list of the
            wrong length, or reaches past the end of the arena.
    """
    typed: dict[str, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for view in views:
        dtype = TORCH_DTYPES.get(view.dtype)
        if dtype is None:
            raise HandleError(f"tensor {view.name!r}: unknown dtype {view.dtype!r}")
        shape, stride = tuple(view.shape), tuple(view.stride)
        _check_view(view, shape, stride, dtype.itemsize, base.numel())
        if view.dtype not in typed:
            typed[view.dtype] = base.view(dtype)
        out[view.name] = torch.as_strided(
            typed[view.dtype], shape, stride, view.byte_offset // dtype.itemsize
        )
    return out


def _check_view(
    view: View,
    shape: tuple[int, ...],
    stride: tuple[int, ...],
    item: int,
    size: int,
) -> None:
    if len(stride) != len(shape) or any(s < 0 for s in (*shape, *stride)):
        raise HandleError(f"tensor {view.name!r}: shape {shape} and stride {stride} disagree")
    if view.byte_offset < 0 or view.byte_offset % item:
        raise HandleError(f"tensor {view.name!r}: misaligned byte_offset {view.byte_offset}")
    if math.prod(shape) == 0:
        extent = 0
    else:
        extent = (1 + sum((d - 1) * s for d, s in zip(shape, stride, strict=True))) * item
    if view.byte_offset + extent > size:
        raise HandleError(f"tensor {view.name!r}: reaches past the {size}-byte arena")

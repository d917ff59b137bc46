"""Arenas: one contiguous allocation per model, tensors 256-byte aligned.

The CPU backend allocates the arena as a file in ``/dev/shm`` created ``O_EXCL`` with mode
0600 and a random name, reserved with ``posix_fallocate`` so that running out of
shared memory fails the load with ENOSPC instead of a SIGBUS in the middle of a write.
Stored tensors are copied into it from the shard files by ``sendfile(2)``, inside the
kernel: no user-space buffer, and no page faults on the daemon's mapping (reading into the
mapping instead ran at about half the speed of ``cp``; bench/README.md).
"""

from __future__ import annotations

import contextlib
import errno
import gc
import math
import mmap
import os
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, BinaryIO, Protocol

from weightcache.core.dtypes import itemsize
from weightcache.core.errors import ResourceExhaustedError
from weightcache.core.records import SharedMemoryHandle, StorageHandle, TensorView
from weightcache.core.sockets import SHM_DIR
from weightcache_service.segments import segment_name

if TYPE_CHECKING:
    # Only a computed tensor (a cast, a shard, a plugin) is written as a tensor, and its
    # code imported torch already: a daemon that copies stored bytes never does (issue 39).
    import torch

#: ``madvise(2)``'s MADV_POPULATE_WRITE (Linux 5.14+; Python's mmap module names it only
#: from 3.13).
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)

ALIGNMENT = 256
#: errno values of a segment creation that mean "out of a resource": space or inodes of
#: the tmpfs (ENOSPC, EDQUOT), file descriptors (EMFILE, ENFILE), kernel memory (ENOMEM).
_EXHAUSTED = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EMFILE, errno.ENFILE, errno.ENOMEM})


class Arena(Protocol):
    """What the store needs of a backend's arena (shared memory, CUDA)."""

    size: int

    def write(self, slot: Slot, tensor: torch.Tensor) -> None:
        """Copy a tensor's bytes into its slot."""

    def read_into(self, slot: Slot, fill: Callable[[memoryview], None]) -> None:
        """Let ``fill`` produce the slot's bytes."""

    def copy_from_file(self, slot: Slot, fd: int, offset: int) -> int:
        """Copy the slot's bytes from file ``fd`` at byte ``offset`` inside the kernel;
        returns how many bytes it copied from the slot's start (the caller provides the
        rest with :meth:`read_into`; 0 where the backend cannot copy from a file)."""

    def handle(self) -> StorageHandle:
        """The handle a worker opens."""

    def close(self) -> None:
        """Free the memory."""


@dataclass(frozen=True)
class Slot:
    """Where one tensor lives in an arena."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    byte_offset: int
    nbytes: int

    def view(self) -> TensorView:
        """The slot as a tensor view (row-major contiguous strides)."""
        stride = tuple(math.prod(self.shape[i + 1 :]) for i in range(len(self.shape)))
        return TensorView(self.name, self.dtype, self.shape, stride, self.byte_offset)


def write_slot(base: torch.Tensor, slot: Slot, tensor: torch.Tensor) -> None:
    """Copy ``tensor``'s bytes into ``slot`` of an arena held as 1-D ``uint8`` ``base``."""
    if slot.nbytes == 0:
        return
    import torch

    raw = tensor.contiguous().reshape(-1).view(torch.uint8)
    base[slot.byte_offset : slot.byte_offset + slot.nbytes].copy_(raw)


def tail(slot: Slot, skip: int) -> Slot:
    """The part of ``slot`` after its first ``skip`` bytes, as a slot of raw bytes."""
    return Slot(slot.name, "U8", (slot.nbytes - skip,), slot.byte_offset + skip, slot.nbytes - skip)


def align(offset: int) -> int:
    """``offset`` rounded up to the arena alignment (256 bytes)."""
    return -(-offset // ALIGNMENT) * ALIGNMENT


def plan_slots(specs: Iterable[tuple[str, str, tuple[int, ...]]]) -> tuple[list[Slot], int]:
    """Lay out tensors ``(name, dtype, shape)`` back to back, each 256-byte aligned.

    Returns the slots and the arena size in bytes (at least one alignment unit, since an
    empty mapping cannot be created).
    """
    slots = []
    cursor = 0
    for name, dtype, shape in specs:
        nbytes = math.prod(shape) * itemsize(dtype)
        offset = align(cursor)
        slots.append(Slot(name, dtype, shape, offset, nbytes))
        cursor = offset + nbytes
    return slots, max(align(cursor), ALIGNMENT)


class SharedMemoryArena:
    """A model's arena in a ``/dev/shm`` file, mapped read-write by the daemon.

    Args:
        size: bytes, a multiple of 256.
        prefix: name prefix (:func:`weightcache_service.segments.segment_prefix`); a
            random component follows (:func:`~weightcache_service.segments.segment_name`).
        mode: permission bits (0600, or 0640 for a group).
        gid: group to give the segment, or None.

    Raises:
        ResourceExhaustedError: /dev/shm has no room for ``size`` bytes, no free inode, or
            the process or system is out of file descriptors.
        OSError: the segment cannot be created for another reason (e.g. EACCES).
    """

    def __init__(self, size: int, prefix: str, mode: int = 0o600, gid: int | None = None) -> None:
        self.size = size
        self.path = os.path.join(SHM_DIR, segment_name(prefix))
        self._closed = False
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            # Nothing was created: there is nothing to unlink (and the name may be another's).
            if exc.errno in _EXHAUSTED:
                raise ResourceExhaustedError(
                    f"cannot create a segment in {SHM_DIR}: {exc.strerror}",
                    metadata={"errno": errno.errorcode.get(exc.errno or 0, "")},
                ) from None
            raise
        try:
            if gid is not None:
                os.fchown(fd, -1, gid)
            os.fchmod(fd, mode)
            os.posix_fallocate(fd, 0, size)
            self._mmap = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        except OSError as exc:
            os.close(fd)
            os.unlink(self.path)
            raise ResourceExhaustedError(
                f"cannot allocate {size} bytes in {SHM_DIR}: {exc.strerror}"
            ) from None
        # Kept open until close(): sendfile(2) writes through it (copy_from_file).
        self._fd = fd
        self._sendfile = True
        self._base: torch.Tensor | None = None

    def write(self, slot: Slot, tensor: torch.Tensor) -> None:
        """Copy ``tensor``'s bytes into its slot (dtype and shape must match the slot)."""
        if self._base is None:
            # Made at the first computed tensor, not at creation: the arena of a plain
            # checkpoint is filled by copy_from_file/read_into, without torch.
            import torch

            self._base = torch.frombuffer(self._mmap, dtype=torch.uint8)
        write_slot(self._base, slot, tensor)

    def populate(self) -> bool:
        """Map every page of the segment writable now, in one ``madvise(2)``
        (``MADV_POPULATE_WRITE``, Linux 5.14+), for a caller about to write every byte
        through the mapping (a seed): one page fault per 4 KiB page otherwise, which on
        this project's VMs cost more CPU than the copy itself. The pages are already
        allocated (``posix_fallocate`` at creation); nothing is written.

        Returns:
            True when populated; False when the kernel refused (older than 5.14, or a
            sandbox): the pages then fault in as they are written, as before.
        """
        try:
            self._mmap.madvise(MADV_POPULATE_WRITE)
        except OSError:
            return False
        return True

    def read_into(self, slot: Slot, fill: Callable[[memoryview], None]) -> None:
        """Let ``fill`` write the slot's bytes straight into shared memory (no copy)."""
        if slot.nbytes == 0:
            return
        with memoryview(self._mmap) as whole:
            fill(whole[slot.byte_offset : slot.byte_offset + slot.nbytes])

    def reader(self) -> BinaryIO:
        """A read-only file of the segment with a file description of its own (opened
        again through ``/proc/self/fd``): its position is its own, and it stays valid
        after :meth:`close` (the kernel keeps an unlinked file's pages while it is open),
        for a data plane that ``sendfile(2)``s from it (:mod:`.sendfile_plane`).

        Raises:
            OSError: the arena is closed, or /proc is not mounted.
        """
        fd = os.open(f"/proc/self/fd/{self._fd}", os.O_RDONLY | os.O_CLOEXEC)
        return os.fdopen(fd, "rb", buffering=0)

    def copy_from_file(self, slot: Slot, fd: int, offset: int) -> int:
        """Copy ``slot.nbytes`` bytes of file ``fd`` from byte ``offset`` into the slot with
        ``sendfile(2)`` (the kernel copies page cache to shared memory; nothing is mapped or
        buffered here). Not thread-safe: it moves the segment descriptor's file position.

        Returns:
            Bytes copied from the slot's start: all of them, or fewer when ``fd`` ended
            early or the kernel refused the call (EINVAL, ENOSYS, a sandbox's EPERM, a read
            error). The caller reads the rest the ordinary way, which reports a short or
            failed read as it always has. After a refusal this arena stops trying: every
            later call returns 0 at once.
        """
        done = 0
        if not self._sendfile or slot.nbytes == 0:
            return done
        try:
            # sendfile(2) writes at the output's file position (no offset argument for it).
            os.lseek(self._fd, slot.byte_offset, os.SEEK_SET)
            while done < slot.nbytes:
                n = os.sendfile(self._fd, fd, offset + done, slot.nbytes - done)
                if n == 0:
                    break  # end of the input file: the caller's read reports it
                done += n
        except OSError:
            # Whatever the reason, the ordinary read path can do the copy, and it reports
            # a real read error in its own words; only the speed is lost.
            self._sendfile = False
        return done

    def handle(self) -> StorageHandle:
        """The handle a worker opens: the segment's path and size."""
        return SharedMemoryHandle(self.path, self.size)

    @classmethod
    def adopt(
        cls, path: str, size: int, new_path: str, mode: int, gid: int | None
    ) -> SharedMemoryArena:
        """Take over a segment a predecessor handed over (:mod:`.handover`): open it,
        check it again on the descriptor, map it, and rename it to ``new_path`` (this
        daemon's name, so that clean-up of dead daemons' segments spares it). Its bytes are
        neither read nor written.

        Raises:
            OSError: it cannot be opened, mapped or renamed, or it is not a regular file of
                ``size`` bytes owned by this user (``EINVAL``).
        """
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_size != size:
                raise OSError(errno.EINVAL, f"{path} is not a {size}-byte segment of this user")
            if gid is not None:
                os.fchown(fd, -1, gid)
            os.fchmod(fd, mode)
            arena = cls.__new__(cls)
            arena.size = size
            arena._closed = False
            arena._mmap = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
            os.rename(path, new_path)
        except BaseException:
            os.close(fd)
            raise
        arena.path = new_path
        arena._fd = fd
        arena._sendfile = False  # nothing more is written into an adopted arena
        arena._base = None
        return arena

    def close(self, *, unlink: bool = True) -> None:
        """Unlink (unless ``unlink`` is False: a hand-over leaves it to the successor) and
        unmap; a second call does nothing. Workers that mapped it keep their pages
        (mmap(2)). Never raises: if a view of the mapping is still referenced somewhere,
        the pages go when that view does."""
        if self._closed:
            return
        self._closed = True
        # Unlink first: the name must go even if the mapping cannot be closed yet.
        if unlink:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        os.close(self._fd)
        self._base = None  # the tensor over the mapping exports its buffer
        try:
            self._mmap.close()
        except BufferError:
            # A view still exports the buffer, e.g. held by a reference cycle of a failed
            # read's frames; collecting the cycles usually releases it.
            gc.collect()
            with contextlib.suppress(BufferError):
                self._mmap.close()

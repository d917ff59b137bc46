"""What a file's identity (dev, inode, size, mtime, ctime) can vouch for.

Two places take an unchanged identity for unchanged bytes: the hash cache
(:mod:`weightcache.core.hashcache`) and the daemon's Acquire by file identity
(``docs/protocol.md``). That holds only when every write after the bytes were read moves
mtime or ctime, and two writes within one timestamp granule do not: on a file system
with 1-second timestamps (ext3, ext4 with 128-byte inodes, many network and FUSE file
systems) a same-size rewrite within the second of the last change keeps the identity;
FAT keeps 2 seconds; even nanosecond file systems stamp with the kernel's coarse clock
(one tick, at most 10 ms). So an identity vouches for bytes read from time ``since`` on
only when the file's last change (the later of mtime and ctime) is more than the file
system's granule before ``since`` (:func:`vouches`): then any later write stamps a
later granule, and the identity moves. Otherwise the caller reads the bytes again.

A write through a shared writable mapping (``mmap``) stamps mtime when it first dirties a
page, not at each write. :func:`settle` writes the file's dirty pages back before it is
read (``sync_file_range(2)``; ``fdatasync(2)`` where that is missing), so that the next
write through a mapping faults and stamps the file again. On file systems that keep
pages in memory only (tmpfs: ``/dev/shm``, a Kubernetes ``emptyDir`` with ``medium:
Memory``, ``/tmp`` on some systems; ramfs) pages are never written back and stay writable
in every mapping once dirtied: a process that keeps a shared writable mapping changes
bytes without a new stamp (measured on Linux 6.18: rewrites of a dirtied page move
neither mtime nor ctime, ``sync_file_range`` and ``fdatasync`` notwithstanding). No
identity can vouch for such a file (:func:`stamps_every_write`, :data:`UNSTAMPED_TYPES`):
:func:`vouches` is always False there, so the hash cache neither remembers nor uses its
digest, and an Acquire by file identity is refused (the worker then sends its
fingerprint, computed from the bytes) (docs/fingerprint.md, "What file identity
guarantees").
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable
from typing import cast

#: Granules, in nanoseconds.
FAT_GRANULE_NS = 2_000_000_000
SECOND_NS = 1_000_000_000
#: Sub-second stamps come from the kernel's coarse clock: one tick (1/HZ, at most 10 ms)
#: behind the clock ``since`` is read from. Five ticks of margin.
FINE_GRANULE_NS = 50_000_000

#: File system types (``/proc/self/mountinfo``) whose timestamps have 2-second granules.
FAT_TYPES = frozenset({"vfat", "msdos", "fat", "exfat", "umsdos"})
#: Types whose timestamps come from another machine's clock or a client-side attribute
#: cache: sub-second digits there prove no sub-second granule; a second is assumed.
REMOTE_TYPES = frozenset(
    {
        "nfs",
        "nfs4",
        "cifs",
        "smb3",
        "smbfs",
        "9p",
        "ceph",
        "glusterfs",
        "afs",
        "lustre",
        "gpfs",
        "beegfs",
        "virtiofs",
    }
)


#: File system types whose pages are never written back, so that writes through a shared
#: mapping to an already dirtied page stamp nothing (module docstring).
UNSTAMPED_TYPES = frozenset({"tmpfs", "ramfs", "hugetlbfs"})


@functools.lru_cache(maxsize=64)
def fs_type(dev: int) -> str:
    """The type of the file system mounted with device number ``dev`` (``ext4``,
    ``fuse.sshfs``...), from ``/proc/self/mountinfo``; ``""`` when unknown."""
    wanted = f"{os.major(dev)}:{os.minor(dev)}"
    with (
        contextlib.suppress(OSError),
        open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as fh,
    ):
        for line in fh:
            fields = line.split()
            if len(fields) > 2 and fields[2] == wanted and " - " in line:
                return line.split(" - ", 1)[1].split()[0]
    return ""


def granule_ns(dev: int, mtime_ns: int, ctime_ns: int) -> int:
    """The timestamp granule assumed for a file of device ``dev`` whose stamps are
    ``mtime_ns`` and ``ctime_ns``: 2 s on FAT; 1 s on network and FUSE file systems, and
    wherever both stamps are whole seconds (a 1-second file system; unknown ones
    included); :data:`FINE_GRANULE_NS` otherwise (the stamps show sub-second digits)."""
    kind = fs_type(dev)
    if kind in FAT_TYPES:
        return FAT_GRANULE_NS
    if kind in REMOTE_TYPES or kind.startswith("fuse"):
        return SECOND_NS
    if mtime_ns % SECOND_NS == 0 and ctime_ns % SECOND_NS == 0:
        return SECOND_NS
    return FINE_GRANULE_NS


def stamps_every_write(dev: int) -> bool:
    """Whether every write to a file of device ``dev`` moves its mtime or ctime, writes
    through a shared mapping included (after :func:`settle`): False on the file systems of
    :data:`UNSTAMPED_TYPES`, whose files' identity never vouches for their bytes."""
    return fs_type(dev) not in UNSTAMPED_TYPES


def vouches(dev: int, mtime_ns: int, ctime_ns: int, since_ns: int) -> bool:
    """Whether an identity with these stamps, unchanged later, proves that the bytes read
    from ``since_ns`` (``time.time_ns()`` taken before the read began) are still the
    file's: the file system stamps every write (:func:`stamps_every_write`), and the
    file's last change is more than one granule (:func:`granule_ns`) before
    ``since_ns``."""
    if not stamps_every_write(dev):
        return False
    return since_ns - max(mtime_ns, ctime_ns) > granule_ns(dev, mtime_ns, ctime_ns)


#: ``sync_file_range(2)`` flags: wait for writeback in flight, write every dirty page of
#: the range, wait for that writeback (linux/fs.h).
_SYNC_FILE_RANGE_ALL = 1 | 2 | 4


@functools.cache
def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's ``sync_file_range``, or None where there is none (not Linux, no glibc
    symbol, ctypes unavailable)."""
    try:
        import ctypes

        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (ImportError, OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return cast(Callable[[int, int, int, int], int], function)


def settle(fd: int) -> None:
    """Write the file's dirty pages back, so that a write through a shared mapping after
    this stamps the file again. Best effort: a file system that refuses (EINVAL, EROFS...)
    is left as it is.

    ``sync_file_range(2)`` over the whole file (allowed on a read-only descriptor): the
    writeback makes every page clean and write-protects it in every mapping, which is all
    the stamp needs, and costs about 1 us on a clean file. ``fdatasync(2)``, the fallback
    where it is missing or refused, also flushes the device's cache: about 3 ms a file on
    the shared VM, 77 % of ``load_from_disk``'s time on a 4-shard checkpoint (issue 29).
    """
    function = _sync_file_range()
    if function is not None and function(fd, 0, 0, _SYNC_FILE_RANGE_ALL) == 0:
        return
    with contextlib.suppress(OSError):
        os.fdatasync(fd)

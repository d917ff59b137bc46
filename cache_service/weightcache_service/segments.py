"""Who owns a /dev/shm segment, and removing the segments of dead daemons.

A daemon names its segments ``weightcache-<socket tag>-<instance>-<pid>-<start>-<random>``:
``pid`` and ``start``, the process's start time in clock ticks since boot (field 22 of
``/proc/PID/stat``, proc(5)), identify the owner even after its pid is reused. A segment
whose owner is gone is garbage whatever socket its daemon served; any daemon removes such
segments at start, and ``weightcache gc`` removes them on demand.

Pids are those of the caller's pid namespace: daemons that share a ``/dev/shm`` must share
a pid namespace too (a daemon in another container would look dead).

``/dev/shm`` is writable by every local user: a name there proves nothing. Before anything
is removed, the entry is opened (``O_PATH | O_NOFOLLOW``, so that nothing is followed and
no FIFO blocks) and checked on that descriptor: a regular file, owned by the remover's
uid (for ``weightcache gc`` as root, by anyone); the name must still lead to that very
file when it is unlinked. Anything else (a folder, a symlink, a FIFO, another user's
file, one that vanished) is skipped and reported (:class:`Skipped`), never an error.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass

from weightcache.core.sockets import SEGMENT_PREFIX, SHM_DIR, tag_prefix

_NAME = re.compile(
    rf"^{re.escape(SEGMENT_PREFIX)}(?P<tag>[0-9a-f]{{12}})-(?P<instance>[0-9a-f]{{12}})-"
    r"(?P<pid>[1-9][0-9]*)-(?P<start>[0-9]+)-[0-9a-f]{32}$"
)


_HANDOVER_NAME = re.compile(
    rf"^{re.escape(SEGMENT_PREFIX)}[0-9a-f]{{12}}-handover-(?P<at>[0-9]+)-[0-9a-f]{{32}}$"
)

#: Seconds a handed-over segment waits for a successor before ``weightcache gc`` takes it
#: for an orphan (a restart, an image pull included, takes far less).
HANDOVER_GRACE = 600


def handover_name(tag: str, at: float | None = None) -> str:
    """The file name a segment takes while handed over to the next daemon on the socket of
    ``tag`` (``weightcache-<tag>-handover-<unix seconds>-<32 hex>``): it names no owner, so
    that the clean-up of dead daemons' segments spares it; the next daemon on that socket
    adopts it or removes it (:func:`remove_stale_segments`), and ``weightcache gc`` removes
    it once :data:`HANDOVER_GRACE` has passed since ``at`` (default: now) with no successor
    (:func:`orphaned_handovers`)."""
    when = int(time.time() if at is None else at)
    return f"{tag_prefix(tag)}handover-{when}-{secrets.token_hex(16)}"


@dataclass(frozen=True)
class HandedOver:
    """A segment handed over that no successor took.

    Attributes:
        path: its path under /dev/shm.
        at: when it was handed over (unix seconds).
        uid: the file's owner.
        size: bytes.
    """

    path: str
    at: int
    uid: int
    size: int


def orphaned_handovers(
    grace: float = HANDOVER_GRACE,
    uid: int | None = None,
    shm_dir: str = SHM_DIR,
    skipped: list[Skipped] | None = None,
) -> list[HandedOver]:
    """Handed-over segments (:func:`handover_name`) that ``uid`` may remove (its own, or
    any for root) and no successor adopted within ``grace`` seconds, sorted by path.

    Raises:
        OSError: ``shm_dir`` cannot be listed.
    """
    uid = os.geteuid() if uid is None else uid
    owner = None if uid == 0 else uid
    now = time.time()
    found = [
        HandedOver(path, int(match["at"]), info.st_uid, info.st_size)
        for path, match, info in _scan(shm_dir, _HANDOVER_NAME, owner, skipped)
        if now - int(match["at"]) >= grace
    ]
    return sorted(found, key=lambda h: h.path)


def remove_handed_over(segment: HandedOver) -> Skipped | None:
    """Unlink a segment :func:`orphaned_handovers` found, if its name still leads to a
    regular file of the same owner; None once removed (or gone), else why not."""
    return _remove_owned(segment.path, segment.uid)


def process_start_time(pid: int) -> int | None:
    """Start time of process ``pid`` in clock ticks after boot, or None when there is no
    such process (field 22 of ``/proc/PID/stat``, proc(5))."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name (field 2) is parenthesised and may hold spaces or parentheses.
    fields = stat[stat.rindex(b")") + 2 :].split()
    return int(fields[22 - 3])


def owner_part(pid: int | None = None) -> str:
    """``<pid>-<start time>`` of this process (or ``pid``), for segment names."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}-{process_start_time(pid)}"


def segment_prefix(tag: str, instance_id: str) -> str:
    """The start of every segment name of this daemon process:
    ``weightcache-<tag>-<first 12 of instance_id>-<pid>-<start>-`` (the owner part lets any
    later daemon tell that this one's segments are garbage once it is gone)."""
    return f"{tag_prefix(tag)}{instance_id[:12]}-{owner_part()}-"


def segment_name(prefix: str) -> str:
    """A new segment's file name: ``prefix`` and 32 random hex digits (what ``_NAME``
    parses back)."""
    return f"{prefix}{secrets.token_hex(16)}"


@dataclass(frozen=True)
class Segment:
    """A segment named by a daemon of this format.

    Attributes:
        path: its path under /dev/shm.
        pid: the owner daemon's pid.
        start: the owner's start time (clock ticks after boot).
        uid: the file's owner.
        size: bytes.
    """

    path: str
    pid: int
    start: int
    uid: int
    size: int

    @property
    def owner_alive(self) -> bool:
        """Whether the process that created it still runs (same pid and start time)."""
        return process_start_time(self.pid) == self.start


@dataclass(frozen=True)
class Skipped:
    """A name in ``/dev/shm`` that looked like a segment to remove but is not the remover's
    to remove.

    Attributes:
        path: the entry.
        why: what it is instead (``"a folder"``, ``"owned by uid 65534, not 0"``, ...).
        owner: the file's uid when it is a regular file skipped for its owner alone.
    """

    path: str
    why: str
    owner: int | None = None


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISLNK(mode):
        return "a symlink"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def inspect(path: str, uid: int | None) -> os.stat_result | Skipped | None:
    """The ``fstat`` of the entry at ``path``, opened without following it, when it is a
    regular file owned by ``uid`` (None: by anyone); None when it is gone; else why it is
    not to be touched.

    Never raises: an entry that cannot be opened (no permission) is :class:`Skipped`.
    """
    try:
        fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return Skipped(path, f"cannot be opened: {exc.strerror}")
    try:
        info = os.fstat(fd)
    finally:
        os.close(fd)
    if not stat.S_ISREG(info.st_mode):
        return Skipped(path, _kind(info.st_mode))
    if uid is not None and info.st_uid != uid:
        return Skipped(path, f"owned by uid {info.st_uid}, not {uid}", owner=info.st_uid)
    return info


def unlink_checked(path: str, info: os.stat_result) -> Skipped | None:
    """Unlink ``path`` if it still names the file :func:`inspect` saw (same device and
    inode); None when it did (or the name is gone already), else why not.

    Never raises.
    """
    try:
        now = os.lstat(path)
        if (now.st_dev, now.st_ino) != (info.st_dev, info.st_ino):
            return Skipped(path, "replaced since it was checked")
        os.unlink(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        code = errno.errorcode.get(exc.errno or 0, "")
        return Skipped(path, f"cannot be removed: {code} ({exc.strerror})")
    return None


def _scan(
    shm_dir: str, pattern: re.Pattern[str], uid: int | None, skipped: list[Skipped] | None
) -> Iterator[tuple[str, re.Match[str], os.stat_result]]:
    """The entries of ``shm_dir`` whose name matches ``pattern`` and that are regular files
    (of ``uid``, when given), with the match and their ``stat``. Other entries with such a
    name go to ``skipped``, except other users' files (theirs to remove, not news).

    Raises:
        OSError: ``shm_dir`` cannot be listed.
    """
    for entry in os.scandir(shm_dir):
        match = pattern.match(entry.name)
        if match is None:
            continue
        info = inspect(entry.path, uid)
        if isinstance(info, Skipped):
            if skipped is not None and info.owner is None:
                skipped.append(info)
        elif info is not None:
            yield entry.path, match, info


def list_segments(
    shm_dir: str = SHM_DIR, uid: int | None = None, skipped: list[Skipped] | None = None
) -> list[Segment]:
    """Every segment in ``shm_dir`` whose name says who owns it and that is a regular file
    (owned by ``uid``, when given), sorted by path. Other entries with such a name are
    appended to ``skipped``, except other users' segments (theirs to remove, not news).

    Raises:
        OSError: ``shm_dir`` cannot be listed.
    """
    found = [
        Segment(path, int(match["pid"]), int(match["start"]), info.st_uid, info.st_size)
        for path, match, info in _scan(shm_dir, _NAME, uid, skipped)
    ]
    return sorted(found, key=lambda s: s.path)


def dead_segments(
    uid: int | None = None, shm_dir: str = SHM_DIR, skipped: list[Skipped] | None = None
) -> list[Segment]:
    """Segments whose owner is dead and that ``uid`` may remove: its own, or any for root
    (``weightcache gc``).

    Args:
        uid: the caller (default: the effective uid).
        skipped: entries named like segments that are not regular files the caller may
            remove are appended to it.

    Raises:
        OSError: ``shm_dir`` cannot be listed.
    """
    uid = os.geteuid() if uid is None else uid
    owner = None if uid == 0 else uid
    return [s for s in list_segments(shm_dir, owner, skipped) if not s.owner_alive]


def remove_dead_segments(
    uid: int | None = None, shm_dir: str = SHM_DIR, skipped: list[Skipped] | None = None
) -> list[Segment]:
    """Unlink the dead segments of ``uid`` (default: the effective uid, root included: a
    daemon removes only its own user's); returns those this call removed. Workers that
    still map one keep their pages (mmap(2)).

    Args:
        skipped: what was not removed, and why, is appended to it.

    Raises:
        OSError: ``shm_dir`` cannot be listed.
    """
    uid = os.geteuid() if uid is None else uid
    removed = []
    for segment in list_segments(shm_dir, uid, skipped):
        if segment.owner_alive:
            continue
        refused = remove_segment(segment)
        if refused is None:
            removed.append(segment)
        elif skipped is not None:
            skipped.append(refused)
    return removed


def remove_segment(segment: Segment) -> Skipped | None:
    """Unlink a segment :func:`list_segments` found, if its name still leads to a regular
    file of the same owner; None once removed (or gone), else why not. Never raises."""
    return _remove_owned(segment.path, segment.uid)


def _remove_owned(path: str, uid: int) -> Skipped | None:
    """Unlink ``path`` if it still leads to a regular file of ``uid``; None once removed
    (or gone), else why not. Never raises."""
    info = inspect(path, uid)
    if info is None or isinstance(info, Skipped):
        return info
    return unlink_checked(path, info)


def remove_stale_segments(
    tag: str, keep_prefix: str, shm_dir: str = SHM_DIR
) -> tuple[list[str], list[Skipped]]:
    """Unlink ``weightcache-<tag>-*`` segments left by an earlier daemon on the same socket
    (in the same mount namespace: the tag says so, :func:`~weightcache.core.sockets.segment_tag`).

    Only the holder of the socket's lock may call this. Kept: this instance's segments
    (their name starts with ``keep_prefix``), those whose owner still runs (a name this
    format parses), and every entry that is not a regular file of this process's
    effective uid.

    Returns:
        The paths removed, and what was skipped and why.

    Raises:
        OSError: ``shm_dir`` cannot be listed.
    """
    removed: list[str] = []
    skipped: list[Skipped] = []
    start = tag_prefix(tag)
    uid = os.geteuid()
    for entry in os.scandir(shm_dir):
        if not entry.name.startswith(start) or entry.name.startswith(keep_prefix):
            continue
        match = _NAME.match(entry.name)
        if match is not None and process_start_time(int(match["pid"])) == int(match["start"]):
            skipped.append(Skipped(entry.path, f"its daemon (pid {match['pid']}) still runs"))
            continue
        info = inspect(entry.path, uid)
        if info is None:
            continue
        refused = info if isinstance(info, Skipped) else unlink_checked(entry.path, info)
        if refused is None:
            removed.append(entry.path)
        else:
            skipped.append(refused)
    return removed, skipped

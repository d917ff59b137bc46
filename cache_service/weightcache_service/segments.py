"""Who owns a /dev/shm segment, and removing the segments of dead daemons.

A daemon names its segments ``weightcache-<socket tag>-<instance>-<pid>-<start>-<random>``:
``pid`` and ``start``, the process's start time in clock ticks since boot (field 22 of
``/proc/PID/stat``, proc(5)), identify the owner even after its pid is reused. A segment
whose owner is gone is garbage whatever socket its daemon served; any daemon removes such
segments at start, and ``weightcache gc`` removes them on demand.

Pids are those of the caller's pid namespace: daemons that share a ``/dev/shm`` must share
a pid namespace too (a daemon in another container would look dead).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from dataclasses import dataclass

from weightcache.core.sockets import SEGMENT_PREFIX, SHM_DIR, tag_prefix

_NAME = re.compile(
    rf"^{re.escape(SEGMENT_PREFIX)}(?P<tag>[0-9a-f]{{12}})-(?P<instance>[0-9a-f]{{12}})-"
    r"(?P<pid>[1-9][0-9]*)-(?P<start>[0-9]+)-[0-9a-f]{32}$"
)


def handover_name(tag: str) -> str:
    """The file name a segment takes while handed over to the next daemon on the socket of
    ``tag`` (``weightcache-<tag>-handover-<32 hex>``): it names no owner, so that the
    clean-up of dead daemons' segments (:func:`dead_segments`, ``weightcache gc``) spares it;
    the next daemon on that socket adopts it or removes it
    (:func:`weightcache_service.arena.remove_stale_segments`)."""
    return f"{tag_prefix(tag)}handover-{secrets.token_hex(16)}"


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


def list_segments(shm_dir: str = SHM_DIR) -> list[Segment]:
    """Every segment in ``shm_dir`` whose name says who owns it, sorted by path.

    Raises:
        OSError: ``shm_dir`` cannot be listed.
    """
    found = []
    for entry in os.scandir(shm_dir):
        match = _NAME.match(entry.name)
        if match is None:
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        found.append(
            Segment(entry.path, int(match["pid"]), int(match["start"]), st.st_uid, st.st_size)
        )
    return sorted(found, key=lambda s: s.path)


def dead_segments(uid: int | None = None, shm_dir: str = SHM_DIR) -> list[Segment]:
    """Segments whose owner is dead and that ``uid`` may remove: its own, or any for root.

    Args:
        uid: the caller (default: the effective uid).

    Raises:
        OSError: ``shm_dir`` cannot be listed.
    """
    uid = os.geteuid() if uid is None else uid
    return [s for s in list_segments(shm_dir) if uid in (0, s.uid) and not s.owner_alive]


def remove_dead_segments(uid: int | None = None, shm_dir: str = SHM_DIR) -> list[Segment]:
    """Unlink :func:`dead_segments`; returns those this call removed. Workers that still
    map one keep their pages (mmap(2)).

    Raises:
        OSError: ``shm_dir`` cannot be listed.
    """
    removed = []
    for segment in dead_segments(uid, shm_dir):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(segment.path)
            removed.append(segment)
    return removed

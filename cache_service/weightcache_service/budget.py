"""The daemon's memory budget: how many bytes of arenas it may hold.

For the CPU backend, what the backend *has* is the smaller of the free space of
``/dev/shm`` (statvfs) and ``MemAvailable`` of ``/proc/meminfo`` (proc(5)): an arena is
both a tmpfs file and resident memory. A preload is refused when it would take the held
bytes over the budget, or leave less than the headroom of what the backend has.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass

from weightcache.core.errors import ResourceExhaustedError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b|%)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_IUNITS = {"ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_size(text: str) -> tuple[int | None, float | None]:
    """Parse ``--max-memory``: bytes (``"8GiB"``, ``"500M"``, ``"1073741824"``) or a
    percentage of what the backend has (``"80%"``). Returns ``(bytes, None)`` or
    ``(None, percent)``.

    Raises:
        ValueError: the text is neither, or a percentage is not in (0, 100].
    """
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"not a size: {text!r} (use bytes like 8GiB, or a percentage)")
    number, unit = float(match.group(1)), (match.group(2) or "").lower()
    if unit == "%":
        if not 0 < number <= 100:
            raise ValueError(f"percentage must be in (0, 100]: {text!r}")
        return None, number
    unit = unit.removesuffix("b") if unit not in ("b",) else ""
    scale = _IUNITS.get(unit) or _UNITS.get(unit)
    if scale is None:
        raise ValueError(f"unknown unit in {text!r}")
    return int(number * scale), None


def cpu_available_bytes(shm_dir: str = "/dev/shm") -> int:
    """What the CPU backend has now: min(free bytes of ``shm_dir``, MemAvailable)."""
    vfs = os.statvfs(shm_dir)
    shm_free = vfs.f_bavail * vfs.f_frsize
    with open("/proc/meminfo", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return min(shm_free, int(line.split()[1]) * 1024)
    return shm_free


@dataclass(eq=False)
class MemoryBudget:
    """Admission control for new arenas.

    Attributes:
        max_bytes: fixed budget in bytes, or None.
        percent: budget as a percentage of what the backend had at start, or None.
        headroom: bytes that must stay available to others after a load.
    """

    max_bytes: int | None = None
    percent: float | None = None
    headroom: int = 256 * 2**20
    available: Callable[[], int] = cpu_available_bytes

    def __post_init__(self) -> None:
        self.bind(self.available)

    def bind(self, available: Callable[[], int]) -> None:
        """Measure against a backend: ``available()`` reads what it has now, in bytes; a
        percentage budget is taken of what it has at this call."""
        self.available = available
        self._start_available = available()

    @property
    def limit(self) -> int | None:
        """The budget in bytes, or None when only the backend's capacity limits."""
        if self.max_bytes is not None:
            return self.max_bytes
        if self.percent is not None:
            return int(self._start_available * self.percent / 100)
        return None

    def check(self, name: str, needed: int, held: int, pending: int = 0, unlinked: int = 0) -> None:
        """Admit an arena of ``needed`` bytes while ``held`` bytes are held, ``pending`` of
        them admitted but not yet allocated (what the backend has does not show those yet,
        so they are taken off it: two loads admitted at once cannot both count on the
        same free bytes), and ``unlinked`` bytes of revoked arenas are still mapped by
        workers (not held, not free: counted against the limit; the backend's free space
        shows them already, as tmpfs frees an unlinked file's pages at its last unmap).

        Raises:
            ResourceExhaustedError: over the budget, or under the headroom; the message
                gives every number, in bytes ("available" net of ``pending``).
        """
        limit = self.limit
        if limit is not None and held + unlinked + needed > limit:
            still = f" and {unlinked} unlinked but still mapped by workers" if unlinked else ""
            metadata = {"needed": str(needed), "held": str(held), "budget": str(limit)}
            if unlinked:
                metadata["unlinked"] = str(unlinked)
            raise ResourceExhaustedError(
                f"{name} needs {needed} bytes; {held} of the {limit}-byte budget are held{still}",
                metadata=metadata,
            )
        available = self.available() - pending
        if needed + self.headroom > available:
            raise ResourceExhaustedError(
                f"{name} needs {needed} bytes plus {self.headroom} of headroom; "
                f"{available} are available",
                metadata={
                    "needed": str(needed),
                    "headroom": str(self.headroom),
                    "available": str(available),
                },
            )

"""What a venv holds against the lock file it was made from (issue 35).

``make`` installs every venv from a lock in ``locks/`` (``uv pip sync``: exactly those
versions). :func:`pins` reads a lock, :func:`installed` what this interpreter's environment
holds, :func:`differences` the two side by side. ``tests/test_lockfile.py`` asserts that a
venv holds exactly its lock; ``make test-latest`` runs this file with ``--diff`` to print
what the newest releases change, without failing.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

#: Not pinned by a lock: the installer that made the venv, and this package (editable).
UNLOCKED = frozenset({"pip", "weightcache"})


def pins(lock: Path) -> dict[str, str]:
    """``{canonical name: version}`` of a ``uv pip compile`` lock: one ``name==version``
    requirement a line, hashes and comments on indented or ``#`` lines.

    Raises:
        ValueError: a requirement line is not pinned with ``==``.
    """
    found: dict[str, str] = {}
    for line in lock.read_text().splitlines():
        if not line or line[0] in " #\t-":
            continue
        requirement = Requirement(line.removesuffix("\\").strip())
        (spec,) = requirement.specifier
        if spec.operator != "==":
            raise ValueError(f"{lock}: {line!r} is not pinned with ==")
        found[canonicalize_name(requirement.name)] = spec.version
    return found


def installed() -> dict[str, str]:
    """``{canonical name: version}`` of every distribution this interpreter sees, less
    :data:`UNLOCKED`."""
    found = {
        canonicalize_name(dist.metadata["Name"]): dist.version
        for dist in importlib.metadata.distributions()
    }
    return {name: version for name, version in found.items() if name not in UNLOCKED}


def differences(lock: Path) -> list[str]:
    """One line per distribution whose version differs between ``lock`` and this venv
    (``name: locked -> installed``, ``-`` where absent), sorted by name."""
    locked, present = pins(lock), installed()
    return [
        f"{name}: {locked.get(name, '-')} -> {present.get(name, '-')}"
        for name in sorted(locked.keys() | present.keys())
        if locked.get(name) != present.get(name)
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--diff", type=Path, required=True, help="the lock file to compare")
    lines = differences(parser.parse_args().diff)
    print(f"{len(lines)} distribution(s) differ from the lock", *lines, sep="\n  ")
    return 0


if __name__ == "__main__":
    sys.exit(main())

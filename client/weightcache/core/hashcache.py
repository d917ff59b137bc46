"""sha256 of whole files, remembered on disk so that a restart re-hashes nothing.

An entry is keyed by (st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns): a file rewritten
in place gets a new mtime and ctime (even when ``utime()`` restores the mtime, ctime
moves, and no user can set it back) and is hashed again. A Hugging Face hub-cache blob
(``.../blobs/<64 hex>``) is named after the sha256 of its content (its Git LFS oid), but a
name is a claim, not a digest (a corrupt or tampered blob keeps its name): blobs are read
and hashed like any file, once per identity.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import tempfile
import threading
from pathlib import Path

_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def cache_dir() -> Path:
    """``$WEIGHTCACHE_HASH_CACHE``, else ``$XDG_CACHE_HOME/weightcache/sha256``, else
    ``~/.cache/weightcache/sha256``."""
    explicit = os.environ.get("WEIGHTCACHE_HASH_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "weightcache" / "sha256"


def file_sha256(path: str | os.PathLike[str], cache: Path | None = None) -> str:
    """Lowercase hex sha256 of a file's bytes (:func:`fd_sha256` of the file opened once).

    Raises:
        OSError: the file cannot be opened or read.
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return fd_sha256(fd, Path(os.path.realpath(path)), cache)
    finally:
        os.close(fd)


def fd_sha256(
    fd: int, path: Path, cache: Path | None = None, *, stop: threading.Event | None = None
) -> str:
    """Lowercase hex sha256 of an open file's bytes, from the cache, or by reading the
    descriptor (then cached).

    Args:
        fd: the open file; read with ``pread``, never reopened by path.
        path: where the opened file really is (for whoever traces reads).
        cache: the cache folder; :func:`cache_dir` by default.
        stop: when set, the read ends early (checked every :data:`CHUNK` bytes).

    Raises:
        InterruptedError: ``stop`` was set before the last byte was read; nothing is
            cached.
        OSError: the file cannot be read. A cache that cannot be written is skipped.
    """
    # The key is the identity before the read: a file changed while it is read keeps
    # its digest under the identity it no longer has, never under its new one.
    entry = _entry(fd, cache)
    cached = _lookup(entry)
    if cached is not None:
        return cached
    digest = _hash(fd, path, stop)
    _store(entry.parent, entry, digest)
    return digest


def cached_sha256(fd: int, cache: Path | None = None) -> str | None:
    """The remembered sha256 of an open file, or None when its identity (dev, inode,
    size, mtime, ctime) has none: one ``fstat`` and one small read, no byte of the file.

    Raises:
        OSError: ``fstat`` fails (a closed descriptor).
    """
    return _lookup(_entry(fd, cache))


def _lookup(entry: Path) -> str | None:
    with contextlib.suppress(OSError):
        cached = entry.read_text().strip()
        if _HEX64.match(cached):
            return cached
    return None


def _entry(fd: int, cache: Path | None) -> Path:
    info = os.fstat(fd)
    key = f"{info.st_dev}-{info.st_ino}-{info.st_size}-{info.st_mtime_ns}-{info.st_ctime_ns}"
    return (cache or cache_dir()) / key


#: Bytes read and hashed at a time.
CHUNK = 1 << 20


def _hash(fd: int, path: Path, stop: threading.Event | None = None) -> str:
    # path: which file, for whoever traces reads (the tests count them)
    digest = hashlib.sha256()
    offset = 0
    while chunk := os.pread(fd, CHUNK, offset):
        if stop is not None and stop.is_set():
            raise InterruptedError(f"hashing {path} stopped at byte {offset}")
        digest.update(chunk)
        offset += len(chunk)
    return digest.hexdigest()


def _store(folder: Path, entry: Path, digest: str) -> None:
    # Write-then-rename so that a concurrent reader never sees half an entry.
    with contextlib.suppress(OSError):
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
        with os.fdopen(fd, "w") as fh:
            fh.write(digest)
        os.replace(tmp, entry)

"""sha256 of whole files, remembered on disk so that a restart re-hashes nothing.

An entry is keyed by (st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns): a file rewritten
in place gets a new mtime and ctime (even when ``utime()`` restores the mtime, ctime
moves, and no user can set it back) and is hashed again. But only a stamp in a later
timestamp granule is a new one: a digest is remembered only when the file's last change
was more than its file system's granule before the read began
(:func:`weightcache.core.timestamps.vouches`), and the file's dirty pages are written back
first (:func:`~weightcache.core.timestamps.settle`); each entry holds the time its read
began (``<sha256> <since_ns>``), checked again when it is used. A Hugging Face hub-cache
blob (``.../blobs/<64 hex>``) is named after the sha256 of its content (its Git LFS oid),
but a name is a claim, not a digest (a corrupt or tampered blob keeps its name): blobs are
read and hashed like any file, once per identity.

Whoever can write the cache folder chooses the digests believed. The folder is used only
when it is a real folder (not a symlink) owned by this process's effective uid and not
writable by group or others, checked on the opened folder; each entry only when it is a
regular file of that uid, not writable by group or others. Otherwise the cache is
ignored (files are hashed, nothing is remembered) with one warning per folder on the
``weightcache.hashcache`` logger.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import secrets
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from weightcache.core.timestamps import settle, vouches

_ENTRY = re.compile(r"^(?P<digest>[0-9a-f]{64}) (?P<since>[0-9]{1,20})$")
_log = logging.getLogger("weightcache.hashcache")
#: Folders already warned about (one warning each per process).
_warned: set[str] = set()


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
    descriptor (then cached when its identity vouches for the bytes read: see the module
    docstring).

    Args:
        fd: the open file; read with ``pread``, never reopened by path.
        path: where the opened file really is (for whoever traces reads).
        cache: the cache folder; :func:`cache_dir` by default.
        stop: when set, the read ends early (checked every :data:`CHUNK` bytes).

    Raises:
        InterruptedError: ``stop`` was set before the last byte was read; nothing is
            cached.
        OSError: the file cannot be read. A cache that cannot be written, or is not
            trusted, is skipped.
    """
    since = time.time_ns()
    settle(fd)
    # The key is the identity before the read: a file changed while it is read keeps
    # its digest under the identity it no longer has, never under its new one.
    info = os.fstat(fd)
    folder = cache or cache_dir()
    cached = _lookup(folder, info)
    if cached is not None:
        return cached
    digest = _hash(fd, path, stop)
    if vouches(info.st_dev, info.st_mtime_ns, info.st_ctime_ns, since):
        _store(folder, _key(info), f"{digest} {since}")
    return digest


def cached_sha256(fd: int, cache: Path | None = None) -> str | None:
    """The remembered sha256 of an open file, or None when its identity (dev, inode,
    size, mtime, ctime) has none it vouches for: one ``fstat`` and one small read, no
    byte of the file.

    Raises:
        OSError: ``fstat`` fails (a closed descriptor).
    """
    return _lookup(cache or cache_dir(), os.fstat(fd))


def _key(info: os.stat_result) -> str:
    return f"{info.st_dev}-{info.st_ino}-{info.st_size}-{info.st_mtime_ns}-{info.st_ctime_ns}"


def _private(info: os.stat_result, kind: int) -> str | None:
    """Why a cache folder or entry (its ``fstat``) is not to be trusted, or None."""
    if stat.S_IFMT(info.st_mode) != kind:
        return "is not a folder" if kind == stat.S_IFDIR else "is not a regular file"
    if info.st_uid != os.geteuid():
        return f"belongs to uid {info.st_uid}, not {os.geteuid()}"
    if info.st_mode & 0o022:
        return f"is writable by others (mode {stat.S_IMODE(info.st_mode):o})"
    return None


@contextlib.contextmanager
def _opened(folder: Path, create: bool) -> Iterator[int | None]:
    """The cache folder opened (``O_NOFOLLOW``) and checked on that descriptor; None when
    it is missing (and not ``create``), unusable or not trusted (warned once)."""
    if create:
        with contextlib.suppress(OSError):
            folder.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileExistsError):
                folder.mkdir(mode=0o700)
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if not isinstance(exc, FileNotFoundError):
            _warn(folder, f"cannot be opened: {exc.strerror} (a symlink is refused)")
        yield None
        return
    try:
        why = _private(os.fstat(fd), stat.S_IFDIR)
        if why is not None:
            _warn(folder, why)
            yield None
        else:
            yield fd
    finally:
        os.close(fd)


def _warn(folder: Path, why: str) -> None:
    if str(folder) not in _warned:
        _warned.add(str(folder))
        _log.warning(
            "hash cache folder %s %s: ignored, files are hashed and nothing is remembered "
            "(use a folder only this user can write)",
            folder,
            why,
        )


def _lookup(folder: Path, info: os.stat_result) -> str | None:
    with _opened(folder, create=False) as dir_fd:
        if dir_fd is None:
            return None
        try:
            fd = os.open(_key(info), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        except OSError:
            return None
        try:
            if _private(os.fstat(fd), stat.S_IFREG) is not None:
                return None  # planted by someone else: not believed
            match = _ENTRY.match(os.read(fd, 128).decode("ascii", "replace").strip())
        finally:
            os.close(fd)
    if match is None:
        return None  # an older entry without the time its read began: hashed again
    if not vouches(info.st_dev, info.st_mtime_ns, info.st_ctime_ns, int(match["since"])):
        return None
    return match["digest"]


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


def _store(folder: Path, key: str, text: str) -> None:
    # Write-then-rename, both inside the checked folder, so that a concurrent reader
    # never sees half an entry.
    with _opened(folder, create=True) as dir_fd:
        if dir_fd is None:
            return
        tmp = f".tmp-{secrets.token_hex(8)}"
        with contextlib.suppress(OSError):
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(tmp, flags, 0o600, dir_fd=dir_fd)
            try:
                os.write(fd, text.encode())
            finally:
                os.close(fd)
            os.replace(tmp, key, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)

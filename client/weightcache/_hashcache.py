"""sha256 of whole files, remembered on disk so that a restart re-hashes nothing.

An entry is keyed by (st_dev, st_ino, st_size, st_mtime_ns): a file rewritten in place
gets a new mtime and is hashed again. A Hugging Face hub-cache blob
(``.../blobs/<64 hex>``) is named after the sha256 of its content (its Git LFS oid), so
its name is used without reading it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import tempfile
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
    """Lowercase hex sha256 of a file's bytes, from the hub blob name, the cache, or by
    reading it (then cached).

    Raises:
        OSError: the file cannot be read. A cache that cannot be written is skipped.
    """
    real = Path(os.path.realpath(path))
    if real.parent.name == "blobs" and _HEX64.match(real.name):
        return real.name
    info = real.stat()
    key = f"{info.st_dev}-{info.st_ino}-{info.st_size}-{info.st_mtime_ns}"
    folder = cache or cache_dir()
    entry = folder / key
    with contextlib.suppress(OSError):
        cached = entry.read_text().strip()
        if _HEX64.match(cached):
            return cached
    digest = _hash(real)
    _store(folder, entry, digest)
    return digest


def _hash(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def _store(folder: Path, entry: Path, digest: str) -> None:
    # Write-then-rename so that a concurrent reader never sees half an entry.
    with contextlib.suppress(OSError):
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
        with os.fdopen(fd, "w") as fh:
            fh.write(digest)
        os.replace(tmp, entry)

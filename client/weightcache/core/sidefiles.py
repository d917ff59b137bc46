"""Small JSON side files of a checkpoint folder (``config.json``), read bounded and confined.

One reader for every side file both ends read (the tensor-parallel plan's
``model_type`` and head counts, the ``vllm`` recipe's ``config.json`` and its sha256): a
``config.json`` that is a symlink to ``/dev/zero`` was read whole (2.85 GB in 5.9 s), and
one that is a FIFO hung the Preload, and SIGTERM could not stop the daemon (issue 37,
item 6). Here the file is opened ``O_NONBLOCK`` (a FIFO does not block the open), must be
a regular file of at most :data:`MAX_SIDE_FILE_BYTES`, and must lie, as opened (its
``/proc/self/fd`` link), inside the checkpoint folder, or inside the folder's Hub cache
repo when the folder is a Hub snapshot (``models--ORG--NAME/snapshots/COMMIT``, whose
files are symlinks into ``../../blobs``). It is read from that descriptor only.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from weightcache.core.errors import InvalidCheckpointError

#: Largest side file read, in bytes (transformers' largest ``config.json`` files are tens
#: of KB).
MAX_SIDE_FILE_BYTES = 2**20


def confining_folder(root: Path) -> Path:
    """The folder a side file of checkpoint folder ``root`` (a realpath) must lie in:
    ``root``, or its Hub cache repo folder when ``root`` is a Hub snapshot."""
    if root.parent.name == "snapshots" and root.parent.parent.name.startswith("models--"):
        return root.parent.parent
    return root


def read_bytes(root: str | os.PathLike[str], name: str) -> bytes | None:
    """The bytes of side file ``name`` of checkpoint folder ``root``; None when absent.

    Raises:
        InvalidCheckpointError: it is not a regular file, is over
            :data:`MAX_SIDE_FILE_BYTES`, resolves outside :func:`confining_folder`, or
            cannot be read; the message names the file.
    """
    folder = Path(os.path.realpath(root))
    path = folder / name
    fd = open_regular(path, MAX_SIDE_FILE_BYTES)
    if fd is None:
        return None
    try:
        real = Path(os.readlink(f"/proc/self/fd/{fd}"))
        allowed = confining_folder(folder)
        if allowed not in real.parents:
            raise InvalidCheckpointError(f"{path}: resolves to {real}, outside {allowed}")
        data = _read_at_most(fd, MAX_SIDE_FILE_BYTES + 1)
    except OSError as exc:
        raise InvalidCheckpointError(f"{path}: {exc.strerror}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_SIDE_FILE_BYTES:  # grew since fstat
        raise InvalidCheckpointError(f"{path}: over {MAX_SIDE_FILE_BYTES} bytes")
    return data


def open_regular(path: str | os.PathLike[str], limit: int, *, follow: bool = True) -> int | None:
    """A descriptor of ``path`` when it is a regular file of at most ``limit`` bytes; None
    when there is no such file. Opened ``O_NONBLOCK`` (a FIFO does not block the open) and,
    without ``follow``, ``O_NOFOLLOW`` (a symlink there is refused). The caller closes it.

    Raises:
        InvalidCheckpointError: it cannot be opened, is not a regular file, or is over
            ``limit`` bytes; the message names the file.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
    try:
        fd = os.open(path, flags if follow else flags | os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            return None
        raise InvalidCheckpointError(f"{path}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InvalidCheckpointError(f"{path}: not a regular file")
        if info.st_size > limit:
            raise InvalidCheckpointError(f"{path}: over {limit} bytes")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_at_most(fd: int, limit: int) -> bytes:
    chunks = []
    left = limit
    while left > 0:
        chunk = os.read(fd, left)
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)

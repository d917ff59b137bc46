"""Whether a daemon socket, and the segments it hands out, may be trusted.

A worker attaches memory another process controls, so it checks who that process is: the
socket and its folder must not be symlinks and must be owned by this user, by root (who
controls the machine anyway), or by the uid the caller names as trusted
(``trusted_uid=``, or ``$WEIGHTCACHE_TRUSTED_UID``). A shared-memory segment must be owned
by the socket's owner.
"""

from __future__ import annotations

import os
import stat

from weightcache.core.errors import UntrustedSocketError

ENV_TRUSTED_UID = "WEIGHTCACHE_TRUSTED_UID"


def trusted_uids(trusted_uid: int | None = None) -> frozenset[int]:
    """This user, root, and the explicitly trusted uid (argument, else the environment).

    Raises:
        UntrustedSocketError: ``$WEIGHTCACHE_TRUSTED_UID`` is not an integer.
    """
    uids = {os.geteuid(), 0}
    if trusted_uid is None and os.environ.get(ENV_TRUSTED_UID):
        try:
            trusted_uid = int(os.environ[ENV_TRUSTED_UID])
        except ValueError:
            raise UntrustedSocketError(f"${ENV_TRUSTED_UID} is not a uid") from None
    if trusted_uid is not None:
        uids.add(trusted_uid)
    return frozenset(uids)


def check_socket(path: str, trusted: frozenset[int]) -> int:
    """Check a daemon socket and its folder; returns the socket owner's uid.

    Raises:
        FileNotFoundError: nothing at ``path``.
        UntrustedSocketError: ``path`` or its folder is a symlink, not a socket / folder,
            or owned by a uid outside ``trusted``.
    """
    folder = os.path.dirname(os.path.abspath(path))
    _check(folder, stat.S_ISDIR, "folder", trusted)
    return _check(path, stat.S_ISSOCK, "socket", trusted)


def _check(path: str, kind: object, what: str, trusted: frozenset[int]) -> int:
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        raise UntrustedSocketError(f"{path}: the daemon's {what} is a symlink; refusing it")
    if not kind(info.st_mode):  # type: ignore[operator]
        raise UntrustedSocketError(f"{path}: not a {what}")
    if info.st_uid not in trusted:
        raise UntrustedSocketError(
            f"{path}: the daemon's {what} belongs to uid {info.st_uid}; trust it with "
            f"trusted_uid= or ${ENV_TRUSTED_UID}"
        )
    return info.st_uid

"""Where a device's daemon listens (the one socket-naming rule), and how the names of
its shared-memory segments are derived from that socket.

The daemon (``weightcache preload --device D``), the admin commands (``weightcache ls
--device D``), the worker SDK (``weightcache.load(path, device=D)``) and the shipped
systemd units all name a socket through :func:`default_socket`, so that a worker that
gives no ``socket=`` meets the daemon of its device.

The rule, first match wins:

1. ``$WEIGHTCACHE_SOCKET``, whatever the device;
2. ``<runtime dir>/cpu.sock`` for the CPU, ``<runtime dir>/GPU-<uuid>.sock`` for a GPU.

The runtime dir is ``$WEIGHTCACHE_RUNTIME_DIR`` if set; else ``/run/weightcache`` as root;
else ``$XDG_RUNTIME_DIR/weightcache``; else ``/tmp/weightcache-<uid>``. A GPU is named by
its UUID, the physical device's, never by an index: a worker whose
``CUDA_VISIBLE_DEVICES`` renumbers the GPUs (``cuda:0`` in a worker started with
``CUDA_VISIBLE_DEVICES=3``) still finds the daemon started for that GPU.

Devices are written as the daemon's ``--device`` takes them: ``"cpu"``, ``"cuda:N"``,
``"N"``, ``"cuda"`` (the current device), a UUID (``"GPU-…"``, ``"MIG-…"``, optionally
after ``cuda:``), an ``int`` N, or a ``torch.device``. Only a GPU given by index needs
torch and a visible device to read its UUID; everything else is plain string work, so
the CPU paths of the admin commands stay fast (``weightcache health`` is an exec probe).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Union

from weightcache.core.errors import DeviceNotVisibleError

if TYPE_CHECKING:
    import torch

#: Overrides the whole rule: the socket of every device.
ENV_SOCKET = "WEIGHTCACHE_SOCKET"
#: Overrides the runtime dir only (the systemd units set it: their daemons are not root).
ENV_RUNTIME_DIR = "WEIGHTCACHE_RUNTIME_DIR"
#: The runtime dir of root, and of the shipped systemd units (``RuntimeDirectory=``).
SYSTEM_RUNTIME_DIR = "/run/weightcache"
CPU = "cpu"
#: Longest Unix socket path, in bytes, without its terminating NUL: ``sockaddr_un.sun_path``
#: is 108 bytes on Linux (unix(7)).
MAX_SOCKET_PATH = 107
#: Where CPU arenas live (POSIX shared memory), and how every segment name starts.
SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "weightcache-"
_UUID_PREFIXES = ("GPU-", "MIG-")

#: What names a device: ``"cpu"``, ``"cuda:N"``, a GPU UUID, an index, a ``torch.device``.
DeviceLike = Union[str, int, "torch.device"]


def default_socket(device: DeviceLike = CPU) -> str:
    """The socket path of ``device``'s daemon, by the rule of this module.

    Args:
        device: ``"cpu"`` (default), ``"cuda:N"``, ``"N"``, ``"cuda"``, a GPU UUID (with or
            without ``cuda:``), an ``int`` N (``cuda:N``) or a ``torch.device``.

    Returns:
        An absolute path unless ``$WEIGHTCACHE_SOCKET`` holds a relative one.

    Raises:
        ValueError: ``device`` names no CPU or CUDA device (``"mps"``, ``"cuda:x"``, a
            negative index, a ``bool``); not raised while ``$WEIGHTCACHE_SOCKET`` is set.
        DeviceNotVisibleError: a GPU given by index whose UUID cannot be read: torch sees
            no CUDA/ROCm device, or fewer than N+1; not raised while
            ``$WEIGHTCACHE_SOCKET`` is set.
    """
    env = os.environ.get(ENV_SOCKET)
    if env:
        return env  # the device is not even read: no CUDA is needed then
    return os.path.join(runtime_dir(), socket_name(device))


def runtime_dir() -> str:
    """The folder of the default sockets (see the module's rule)."""
    explicit = os.environ.get(ENV_RUNTIME_DIR)
    if explicit:
        return explicit
    if os.geteuid() == 0:
        return SYSTEM_RUNTIME_DIR
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return os.path.join(xdg, "weightcache")
    return f"/tmp/weightcache-{os.geteuid()}"


def no_socket(socket: str) -> str:
    """Why a worker or command finds nothing at ``socket``, with the rule that named it
    and what a user other than the daemon's sets (a message for a
    :class:`~weightcache.core.errors.DaemonUnavailableError`)."""
    if os.environ.get(ENV_SOCKET):
        how = f"${ENV_SOCKET}"
    else:
        how = (
            f"the runtime dir {runtime_dir()} (${ENV_RUNTIME_DIR}, else {SYSTEM_RUNTIME_DIR} "
            "as root, $XDG_RUNTIME_DIR/weightcache, /tmp/weightcache-<uid>)"
        )
    return (
        f"no daemon socket at {socket} (named by {how}); a process that does not run as "
        f"the daemon's user sets ${ENV_RUNTIME_DIR} or ${ENV_SOCKET} to the daemon's"
    )


def socket_denied(socket: str, strerror: str | None) -> str:
    """Why a worker or command may not connect to ``socket``: the socket and its folder
    are the daemon's user's only, unless the daemon runs with ``--group``."""
    return (
        f"cannot reach the daemon socket {socket}: {strerror or 'Permission denied'}; the "
        "socket and its folder are the daemon's user's only, unless the daemon runs with "
        "--group GROUP (folder 0750, socket 0660) and this process is in that group"
    )


def socket_name(device: DeviceLike) -> str:
    """``cpu.sock``, or ``GPU-<uuid>.sock`` (the UUID as ``nvidia-smi -L`` prints it).

    Raises:
        ValueError, DeviceNotVisibleError: as in :func:`default_socket`.
    """
    text = parse_device(device)
    if text == CPU:
        return f"{CPU}.sock"
    target = text.removeprefix("cuda:")
    if target.startswith(_UUID_PREFIXES):
        return f"{target}.sock"
    return f"{_uuid_of(None if target == 'cuda' else int(target), text)}.sock"


def parse_device(device: DeviceLike) -> str:
    """``device`` written as ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or a bare UUID; no CUDA
    call is made.

    Raises:
        ValueError: ``device`` names no CPU or CUDA device (``"mps"``, ``"cuda:x"``, a
            negative index, a ``bool``).
    """
    usage = "use cpu, cuda:N, N, cuda, a GPU-/MIG- UUID, an index or a torch.device"
    if isinstance(device, bool):  # a bool is an int, and True is no device
        raise ValueError(f"device {device!r}: {usage}")
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"device {device}: an index is 0 or more")
        return f"cuda:{device}"
    text = str(device)  # a torch.device prints as "cpu", "cuda" or "cuda:N"
    target = text.removeprefix("cuda:")
    if text in (CPU, "cuda") or target.startswith(_UUID_PREFIXES):
        return target if target.startswith(_UUID_PREFIXES) else text
    if target.isdigit():
        return f"cuda:{int(target)}"
    raise ValueError(f"device {text!r}: {usage}")


def _uuid_of(index: int | None, shown: str) -> str:
    """The UUID of this process's device ``index`` (the current one for None)."""
    import torch  # only here: the CPU paths must not pay for it

    from weightcache.core.cuda import device_uuid

    if not torch.cuda.is_available():
        raise DeviceNotVisibleError(
            f"device {shown}: torch {torch.__version__} sees no CUDA/ROCm device, so its "
            f"UUID (which names its daemon's socket) cannot be read "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')})"
        )
    try:
        count = torch.cuda.device_count()
        if index is None:
            index = torch.cuda.current_device()
    except RuntimeError as exc:  # e.g. CUDA re-initialized in a forked child, old driver
        raise DeviceNotVisibleError(f"device {shown}: torch cannot use CUDA: {exc}") from None
    if index >= count:
        raise DeviceNotVisibleError(
            f"device {shown}: this process sees {count} device(s) "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')})"
        )
    return device_uuid(index)


def segment_tag(socket: str) -> str:
    """The 12 lowercase hex digits that the daemon serving ``socket`` puts in its segment
    names (``weightcache-<tag>-…``): the sha256 of this process's mount namespace
    (:func:`mount_namespace`) and the socket's path with its folder resolved.

    The folder is resolved, not the socket itself: a symlink planted at the socket path must
    not lend the daemon another socket's tag (and that socket's segments to clean up). The
    mount namespace is in it because one path names different sockets in different
    namespaces (two containers sharing ``/dev/shm``, each with its own ``/run``): their
    daemons hold different locks, and neither may take the other's segments for its
    predecessor's.
    """
    import hashlib  # here: the admin commands name no segment (issue 39)

    folder, name = os.path.split(os.path.abspath(socket))
    path = os.path.join(os.path.realpath(folder), name)
    return hashlib.sha256(f"{mount_namespace()}\0{path}".encode()).hexdigest()[:12]


#: Where Linux names this process's mount namespace (namespaces(7)).
MOUNT_NAMESPACE = "/proc/self/ns/mnt"


def mount_namespace() -> str:
    """This process's mount namespace as ``<st_dev>:<st_ino>`` of :data:`MOUNT_NAMESPACE`
    (what namespaces(7) says identifies it), or ``""`` where it cannot be read (no
    ``/proc``)."""
    try:
        info = os.stat(MOUNT_NAMESPACE)
    except OSError:
        return ""
    return f"{info.st_dev}:{info.st_ino}"


def tag_prefix(tag: str) -> str:
    """How the names of every segment of the daemons on one socket start:
    ``weightcache-<tag>-`` (``tag`` from :func:`segment_tag`)."""
    return f"{SEGMENT_PREFIX}{tag}-"

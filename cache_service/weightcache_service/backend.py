"""Choosing the backend for ``--device``: CPU shared memory, or CUDA/ROCm IPC.

The device is resolved once per daemon (:func:`resolve_device`, called by the CLI): the
same :class:`Device` then names the socket (by the rule of :mod:`weightcache.core.sockets`)
and opens the backend (:func:`open_backend`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from weightcache.core.sockets import CPU, parse_device
from weightcache_service.access import Access
from weightcache_service.arena import Arena, SharedMemoryArena
from weightcache_service.budget import cpu_available_bytes


class DeviceError(RuntimeError):
    """``--device`` names no usable device."""


@dataclass(frozen=True)
class Backend:
    """Where arenas live.

    Attributes:
        name: ``"cpu_shm"`` or ``"cuda_ipc"``.
        device: ``"cpu"`` or ``"cuda:N"``.
        device_uuid: the GPU's UUID; empty for the CPU.
        make_arena: allocates an arena of a size in bytes.
        available: bytes the backend has free now.
        unlink_keeps_mappings: freeing an arena leaves the workers' mappings of it
            readable, with the same bytes, until they unmap it (shared memory: an
            unlinked file lives on while mapped, mmap(2)); then a revoke drops the model
            at once and nobody copies. False on a GPU, where freed memory is gone.
    """

    name: str
    device: str
    device_uuid: str
    make_arena: Callable[[int], Arena]
    available: Callable[[], int]
    unlink_keeps_mappings: bool = False


def cpu_backend(segment_prefix: str, access: Access) -> Backend:
    """Shared-memory arenas in /dev/shm, named with ``segment_prefix``."""

    def make(size: int) -> Arena:
        return SharedMemoryArena(size, segment_prefix, mode=access.segment_mode, gid=access.gid)

    return Backend("cpu_shm", "cpu", "", make, cpu_available_bytes, unlink_keeps_mappings=True)


@dataclass(frozen=True)
class Device:
    """A daemon's device, resolved once at start.

    Attributes:
        index: the local CUDA index; None for the CPU.
        uuid: the GPU's physical UUID (``GPU-…``); empty for the CPU.
    """

    index: int | None
    uuid: str

    @property
    def socket_device(self) -> str:
        """The device as the socket rule names it: ``"cpu"`` or the GPU's UUID (which
        needs no CUDA call to name a socket)."""
        return self.uuid or CPU


#: The CPU: shared-memory arenas.
CPU_DEVICE = Device(None, "")


def resolve_device(device: str) -> Device:
    """The device ``--device`` names: ``cpu``, ``cuda``, ``cuda:N``, ``N`` or a GPU UUID.

    Raises:
        DeviceError: the text names no device, torch sees no CUDA/ROCm device, or none
            matching.
    """
    try:
        text = parse_device(device)
    except ValueError as exc:
        raise DeviceError(f"--device {device}: {exc}") from None
    if text == CPU:
        return CPU_DEVICE
    import torch  # only for a GPU: a CPU daemon never imports torch (issue 39)

    from weightcache.core.cuda import device_uuid, local_index  # ctypes: a GPU's only

    if not torch.cuda.is_available():
        raise DeviceError(f"--device {device}: torch sees no CUDA/ROCm device")
    target = text.removeprefix("cuda:")
    if text == "cuda":
        index = torch.cuda.current_device()
    elif target.isdigit():
        index = int(target)
        if index >= torch.cuda.device_count():
            raise DeviceError(f"--device {device}: only {torch.cuda.device_count()} visible")
    else:
        try:
            index = local_index(target)
        except Exception as exc:
            raise DeviceError(str(exc)) from None
    return Device(index, device_uuid(index))


def cuda_backend(index: int) -> Backend:
    """Arenas of ``cudaMalloc`` memory on device ``index``, exported by CUDA IPC."""
    from weightcache.core.cuda import device_uuid
    from weightcache_service.cuda_arena import CudaArena

    def make(size: int) -> Arena:
        return CudaArena(size, index)

    import torch

    def available() -> int:
        return int(torch.cuda.mem_get_info(index)[0])

    return Backend("cuda_ipc", f"cuda:{index}", device_uuid(index), make, available)


def open_backend(device: Device, segment_prefix: str, access: Access) -> Backend:
    """The backend of a resolved device: the CPU's shared memory (segments named with
    ``segment_prefix``), else CUDA IPC on the GPU."""
    if device.index is None:
        return cpu_backend(segment_prefix, access)
    return cuda_backend(device.index)

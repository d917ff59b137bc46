"""Choosing the backend for ``--device``: CPU shared memory, or CUDA/ROCm IPC."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from weightcache.core.cuda import device_uuid, local_index
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
    """

    name: str
    device: str
    device_uuid: str
    make_arena: Callable[[int], Arena]
    available: Callable[[], int]


def cpu_backend(segment_prefix: str, access: Access) -> Backend:
    """Shared-memory arenas in /dev/shm, named with ``segment_prefix``."""

    def make(size: int) -> Arena:
        return SharedMemoryArena(size, segment_prefix, mode=access.segment_mode, gid=access.gid)

    return Backend("cpu_shm", "cpu", "", make, cpu_available_bytes)


def resolve_device(device: str) -> int:
    """The local index of ``cuda:N``, ``N`` or a ``GPU-...`` UUID.

    Raises:
        DeviceError: no CUDA device, or none matching.
    """
    if not torch.cuda.is_available():
        raise DeviceError(f"--device {device}: torch sees no CUDA/ROCm device")
    text = device.removeprefix("cuda:")
    if text.isdigit():
        index = int(text)
        if index >= torch.cuda.device_count():
            raise DeviceError(f"--device {device}: only {torch.cuda.device_count()} visible")
        return index
    try:
        return local_index(text)
    except Exception as exc:
        raise DeviceError(str(exc)) from None


def cuda_backend(index: int) -> Backend:
    """Arenas of ``cudaMalloc`` memory on device ``index``, exported by CUDA IPC."""
    from weightcache_service.cuda_arena import CudaArena

    def make(size: int) -> Arena:
        return CudaArena(size, index)

    def available() -> int:
        return int(torch.cuda.mem_get_info(index)[0])

    return Backend("cuda_ipc", f"cuda:{index}", device_uuid(index), make, available)


def open_backend(device: str, segment_prefix: str, access: Access) -> Backend:
    """The backend for ``--device``: ``"cpu"`` (shared memory, segments named with
    ``segment_prefix``), else a CUDA device (``cuda:N``, ``N`` or a ``GPU-...`` UUID).

    Raises:
        DeviceError: no CUDA device, or none matching.
    """
    if device == "cpu":
        return cpu_backend(segment_prefix, access)
    return cuda_backend(resolve_device(device))

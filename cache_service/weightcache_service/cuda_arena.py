"""The CUDA (ROCm) backend: one ``cudaMalloc`` allocation per model, exported by IPC.

The arena is its own allocation, not a block of torch's caching allocator, because
``cudaIpcGetMemHandle`` exports a whole allocation from its base (CUDA Runtime API,
"Interprocess communication"): a worker maps exactly the arena and nothing else. Tensors
are processed by the recipe on the CPU, then copied to their slot on the device.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from weightcache.core.cuda import IPC_HANDLE_BYTES, device_tensor, device_uuid, runtime
from weightcache.core.errors import CudaError, ResourceExhaustedError
from weightcache.core.records import CudaIpcHandle, StorageHandle
from weightcache_service.arena import Slot, write_slot


class CudaArena:
    """A model's arena in device memory.

    Args:
        size: bytes, a multiple of 256.
        index: the device, as this process numbers it.

    Raises:
        ResourceExhaustedError: the device has no room for ``size`` bytes.
    """

    def __init__(self, size: int, index: int) -> None:
        self.size = size
        self.index = index
        self.uuid = device_uuid(index)
        self._closed = False
        rt = runtime()
        with torch.cuda.device(index):
            rt.set_device(index)
            try:
                self._ptr = rt.malloc(size)
            except CudaError as exc:
                raise ResourceExhaustedError(
                    f"cannot allocate {size} bytes on cuda:{index}: {exc}"
                ) from None
            try:
                self._handle = rt.ipc_get_handle(self._ptr)
                if len(self._handle) != IPC_HANDLE_BYTES:
                    raise CudaError(f"the runtime gave a {len(self._handle)}-byte IPC handle")
                self._base = device_tensor(self._ptr, size, index)
            except CudaError:
                rt.free(self._ptr)
                raise

    def write(self, slot: Slot, tensor: torch.Tensor) -> None:
        """Copy ``tensor``'s bytes (on any device) into its slot."""
        write_slot(self._base, slot, tensor)

    def read_into(self, slot: Slot, fill: Callable[[memoryview], None]) -> None:
        """Let ``fill`` write the slot's bytes into a pinned host buffer, then copy it up."""
        if slot.nbytes == 0:
            return
        staging = torch.empty(slot.nbytes, dtype=torch.uint8, pin_memory=True)
        fill(staging.numpy().data)
        write_slot(self._base, slot, staging)

    def copy_from_file(self, slot: Slot, fd: int, offset: int) -> int:
        """Copies nothing (device memory is no file): returns 0, and :meth:`read_into`
        does the copy."""
        return 0

    def handle(self) -> StorageHandle:
        """The handle: device UUID, the raw 64-byte IPC handle, size. Called once the
        load is done; it waits for every copy to land before anyone can map the arena."""
        torch.cuda.synchronize(self.index)
        return CudaIpcHandle(self.uuid, bytes(self._handle), self.size)

    def close(self) -> None:
        """Free the allocation (after every lease on it has ended); a second call does
        nothing (a second cudaFree of the pointer could free someone else's memory)."""
        if self._closed:
            return
        self._closed = True
        self._base = torch.empty(0, dtype=torch.uint8)
        with torch.cuda.device(self.index):
            torch.cuda.synchronize(self.index)
            rt = runtime()
            rt.set_device(self.index)
            rt.free(self._ptr)

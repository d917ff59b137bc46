"""CUDA (and HIP) device memory shared between processes with legacy IPC handles.

Bindings to the runtime's IPC calls through ctypes, because torch exposes no public API to
export one allocation as a raw ``cudaIpcMemHandle_t`` or to open one (its own sharing
passes private tuples and the caching allocator's block offsets). The calls and their
rules are those of the CUDA Runtime API reference, "Interprocess communication":

- ``cudaIpcGetMemHandle`` exports the *base* of an allocation made with ``cudaMalloc``
  (not the caching allocator's expandable segments): the daemon allocates each arena
  with its own ``cudaMalloc``.
- ``cudaIpcOpenMemHandle`` may be called once per handle per process (per context); a
  second open of the same handle fails, so opened arenas are counted and shared here.
- The handle is 64 bytes (``CU_IPC_HANDLE_SIZE``); HIP's ``hipIpcMemHandle_t`` has the same
  size and the same calls with the ``hip`` prefix.

Devices are named by UUID, never by index: an index depends on ``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import ctypes
import glob
import os
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from weightcache.core.errors import CudaError, DeviceNotVisibleError

if TYPE_CHECKING:
    # torch is imported by each function that needs it: a CPU daemon imports this module
    # (device UUIDs for the socket rule) and must not pay for torch (issue 39).
    import torch

IPC_HANDLE_BYTES = 64
#: cudaIpcMemLazyEnablePeerAccess
_LAZY_PEER_ACCESS = 1


def is_rocm() -> bool:
    """Whether the installed torch is a ROCm (HIP) build."""
    import torch

    return getattr(torch.version, "hip", None) is not None


def _mapped_libraries(stem: str) -> list[str]:
    """Paths of libraries named ``stem*`` already mapped into this process (Linux)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.current_device()  # initializes CUDA: torch loads its runtime
    found: list[str] = []
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                if os.path.basename(path).startswith(stem) and path not in found:
                    found.append(path)
    except OSError:
        pass
    return found


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


class Runtime:
    """The CUDA or HIP runtime library, loaded once.

    Raises:
        CudaError: no runtime library can be found.
    """

    def __init__(self) -> None:
        self.prefix = "hip" if is_rocm() else "cuda"
        self._lib = self._load()

    def _load(self) -> ctypes.CDLL:
        name = "libamdhip64.so" if self.prefix == "hip" else "libcudart.so"
        # The copy torch already loaded first: a second copy of the runtime (another
        # version on LD_LIBRARY_PATH) would have its own contexts and handles.
        candidates = _mapped_libraries(name.removesuffix(".so"))
        import torch

        torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
        candidates += sorted(glob.glob(os.path.join(torch_lib, name + "*")))
        try:
            import nvidia.cuda_runtime as runtime_pkg  # type: ignore[import-not-found]

            candidates += sorted(
                glob.glob(os.path.join(runtime_pkg.__path__[0], "lib", name + "*"))
            )
        except ImportError:
            pass
        candidates += [name + ".13", name + ".12", name + ".7", name + ".6", name]
        for candidate in candidates:
            try:
                return ctypes.CDLL(candidate)
            except OSError:
                continue
        raise CudaError(f"cannot load {name}: no CUDA/HIP runtime library found")

    def _call(self, name: str, *args: Any) -> None:
        fn = getattr(self._lib, self.prefix + name)
        code = fn(*args)
        if code != 0:
            # A failed call is also this thread's "last error", which torch reads with
            # cudaGetLastError after its own kernel launches: clear it, or torch would later
            # report this failure as its own (e.g. after a fallback to disk).
            getattr(self._lib, self.prefix + "GetLastError")()
            get_string = getattr(self._lib, self.prefix + "GetErrorString")
            get_string.restype = ctypes.c_char_p
            raise CudaError(f"{self.prefix}{name} failed: {get_string(code).decode()} ({code})")

    def set_device(self, index: int) -> None:
        """Make ``index`` current for this thread."""
        self._call("SetDevice", ctypes.c_int(index))

    def malloc(self, size: int) -> int:
        """``cudaMalloc``: a new allocation of ``size`` bytes; returns its device address."""
        ptr = ctypes.c_void_p()
        self._call("Malloc", ctypes.byref(ptr), ctypes.c_size_t(size))
        return int(ptr.value or 0)

    def free(self, ptr: int) -> None:
        """``cudaFree``."""
        self._call("Free", ctypes.c_void_p(ptr))

    def ipc_get_handle(self, ptr: int) -> bytes:
        """``cudaIpcGetMemHandle`` of an allocation's base: 64 raw bytes."""
        handle = _IpcHandle()
        self._call("IpcGetMemHandle", ctypes.byref(handle), ctypes.c_void_p(ptr))
        return ctypes.string_at(ctypes.byref(handle), IPC_HANDLE_BYTES)

    def ipc_open(self, raw: bytes) -> int:
        """``cudaIpcOpenMemHandle`` with lazy peer access; returns the mapped address."""
        handle = _IpcHandle.from_buffer_copy(raw)
        ptr = ctypes.c_void_p()
        self._call("IpcOpenMemHandle", ctypes.byref(ptr), handle, ctypes.c_uint(_LAZY_PEER_ACCESS))
        return int(ptr.value or 0)

    def ipc_close(self, ptr: int) -> None:
        """``cudaIpcCloseMemHandle``."""
        self._call("IpcCloseMemHandle", ctypes.c_void_p(ptr))


_runtime: Runtime | None = None
_runtime_lock = threading.Lock()


def runtime() -> Runtime:
    """The process's runtime binding (loaded on first use)."""
    global _runtime  # noqa: PLW0603 - one binding per process
    with _runtime_lock:
        if _runtime is None:
            _runtime = Runtime()
        return _runtime


def format_uuid(raw: object) -> str:
    """A device UUID as ``nvidia-smi -L`` prints it: ``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``.

    Accepts what ``torch.cuda.get_device_properties(i).uuid`` gives (a ``uuid.UUID``-like
    object or its string), with or without the ``GPU-`` prefix.
    """
    text = str(raw)
    return text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"


def device_uuid(index: int) -> str:
    """UUID of local device ``index`` (as this process numbers them)."""
    import torch

    return format_uuid(torch.cuda.get_device_properties(index).uuid)


def local_index(uuid: str, uuids: list[str] | None = None) -> int:
    """This process's index of the device with ``uuid``.

    Args:
        uuid: as :func:`format_uuid` writes it.
        uuids: the visible devices' UUIDs in index order; read from torch when None.

    Raises:
        DeviceNotVisibleError: no visible device has that UUID.
    """
    if uuids is None:
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        uuids = [device_uuid(i) for i in range(count)]
    wanted = format_uuid(uuid)
    for index, candidate in enumerate(uuids):
        if format_uuid(candidate) == wanted:
            return index
    masks = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")
    shown = "; ".join(f"{m}={os.environ[m]}" for m in masks if m in os.environ)
    raise DeviceNotVisibleError(
        f"device {wanted} is not visible to this process "
        f"({shown or 'CUDA_VISIBLE_DEVICES=<unset>'}; visible: {uuids})"
    )


class _DeviceBuffer:
    """Exposes device memory through ``__cuda_array_interface__`` (version 3) so that
    ``torch.as_tensor`` views it without copying; the owner of the memory's lifetime."""

    def __init__(self, ptr: int, size: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (size,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }


def device_tensor(ptr: int, size: int, index: int, on_free: Any = None) -> torch.Tensor:
    """A 1-D ``uint8`` tensor of ``size`` bytes at device address ``ptr`` on device
    ``index``, without copying. ``on_free()`` runs once the last view of it is gone."""
    owner = _DeviceBuffer(ptr, size)
    if on_free is not None:
        weakref.finalize(owner, on_free)
    import torch

    tensor = torch.as_tensor(owner, device=torch.device("cuda", index))
    if tensor.data_ptr() != ptr:
        # as_tensor copies when the memory is on another device than asked: that would be
        # a silent copy, and the view would not be of the arena.
        raise CudaError(f"device memory at {ptr:#x} is not on cuda:{index}")
    return tensor


@dataclass
class _Opened:
    ptr: int
    refs: int
    index: int


_opened: dict[bytes, _Opened] = {}
# Reentrant: the garbage collector may run _release (a finalizer) on a thread that is
# already inside open_ipc's locked section.
_opened_lock = threading.RLock()


def open_ipc(raw: bytes, size: int, index: int) -> torch.Tensor:
    """Open an arena's IPC handle (once per process) as a 1-D ``uint8`` device tensor.

    The mapping is closed when the last tensor built on any opening of it is gone.

    Raises:
        CudaError: the handle is not 64 bytes, or the runtime refuses to open it.
    """
    if len(raw) != IPC_HANDLE_BYTES:
        raise CudaError(f"an IPC handle is {IPC_HANDLE_BYTES} bytes, not {len(raw)}")
    with _opened_lock:
        opened = _opened.get(raw)
        if opened is None:
            rt = runtime()
            import torch

            with torch.cuda.device(index):  # restores the caller's current device after
                rt.set_device(index)
                opened = _opened[raw] = _Opened(rt.ipc_open(raw), 0, index)
        opened.refs += 1
    return device_tensor(opened.ptr, size, index, on_free=lambda: _release(raw))


def _release(raw: bytes) -> None:
    with _opened_lock:
        opened = _opened.get(raw)
        if opened is None:
            return
        opened.refs -= 1
        if opened.refs == 0:
            del _opened[raw]
            # Unmap on the device it was opened on, once the kernels queued there have
            # finished: the last view can go while a kernel still reads the mapping.
            import torch

            with torch.cuda.device(opened.index):
                torch.cuda.synchronize()
                rt = runtime()
                rt.set_device(opened.index)
                rt.ipc_close(opened.ptr)

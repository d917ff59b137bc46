"""safetensors dtype names, their sizes, and their torch equivalents (torch imported only
when those are first asked for).

Names follow the safetensors format specification (``Dtype`` in safetensors' ``tensor.rs``);
the torch equivalents are those of ``safetensors.torch`` (``_TYPES``, safetensors 0.8).
Every dtype that both safetensors and torch read is supported, except the sub-byte ones
(``F4``, ``F6_E2M3``, ``F6_E3M2``): safetensors stores their shape in elements but torch
packs two ``F4`` per byte (``float4_e2m1fn_x2``), so their byte size is not
``elements * itemsize``; they are refused by name (:data:`SUB_BYTE`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    #: safetensors dtype name -> torch dtype. Every entry round-trips bitwise. Built at its
    #: first use (module ``__getattr__``, PEP 562), when torch is imported.
    TORCH_DTYPES: dict[str, torch.dtype]
    #: torch dtype -> safetensors dtype name (built with :data:`TORCH_DTYPES`).
    SAFETENSORS_NAMES: dict[torch.dtype, str]

#: safetensors dtype name -> bytes per element, without torch: the names and sizes of
#: :data:`TORCH_DTYPES`, which ``tests/test_attach.py`` holds equal to it. Headers, arenas
#: and views are planned from this table, so that a daemon serving plain checkpoints never
#: imports torch (issue 39).
ITEMSIZES: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "U16": 2,
    "I16": 2,
    "U32": 4,
    "I32": 4,
    "U64": 8,
    "I64": 8,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E4M3FNUZ": 1,
    "F8_E5M2FNUZ": 1,
    "F8_E8M0": 1,
    "BF16": 2,
    "F16": 2,
    "F32": 4,
    "F64": 8,
    "C64": 8,
}

#: The torch attribute of each safetensors name, for :data:`TORCH_DTYPES`.
_TORCH_NAMES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "U16": "uint16",
    "I16": "int16",
    "U32": "uint32",
    "I32": "int32",
    "U64": "uint64",
    "I64": "int64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu",
    "BF16": "bfloat16",
    "F16": "float16",
    "F32": "float32",
    "F64": "float64",
    "C64": "complex64",
}


def __getattr__(name: str) -> Any:
    """:data:`TORCH_DTYPES` and :data:`SAFETENSORS_NAMES`, built (importing torch) at the
    first access and kept as module attributes.

    Raises:
        AttributeError: any other name.
    """
    if name not in ("TORCH_DTYPES", "SAFETENSORS_NAMES"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import torch

    table = {key: getattr(torch, attr) for key, attr in _TORCH_NAMES.items()}
    globals()["TORCH_DTYPES"] = table
    globals()["SAFETENSORS_NAMES"] = {v: k for k, v in table.items()}
    return globals()[name]


#: safetensors dtypes narrower than a byte, refused with a message naming them.
SUB_BYTE = frozenset({"F4", "F6_E2M3", "F6_E3M2"})

#: dtypes a ``dtype`` recipe casts; integer, bool, complex and fp8 tensors are left as
#: stored (casting them would lose information).
CASTABLE = frozenset({"BF16", "F16", "F32", "F64"})


def itemsize(dtype: str) -> int:
    """Bytes per element of a safetensors dtype name.

    Raises:
        KeyError: the name is not a supported safetensors dtype.
    """
    return ITEMSIZES[dtype]

"""safetensors dtype names and their torch equivalents.

Names follow the safetensors format specification (``Dtype`` in safetensors' ``tensor.rs``);
the torch equivalents are those of ``safetensors.torch`` (``_TYPES``, safetensors 0.8).
Every dtype that both safetensors and torch read is supported, except the sub-byte ones
(``F4``, ``F6_E2M3``, ``F6_E3M2``): safetensors stores their shape in elements but torch
packs two ``F4`` per byte (``float4_e2m1fn_x2``), so their byte size is not
``elements * itemsize``; they are refused by name (:data:`SUB_BYTE`).
"""

from __future__ import annotations

import torch

#: safetensors dtype name -> torch dtype. Every entry round-trips bitwise.
TORCH_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "U16": torch.uint16,
    "I16": torch.int16,
    "U32": torch.uint32,
    "I32": torch.int32,
    "U64": torch.uint64,
    "I64": torch.int64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    "F8_E8M0": torch.float8_e8m0fnu,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "C64": torch.complex64,
}

#: safetensors dtypes narrower than a byte, refused with a message naming them.
SUB_BYTE = frozenset({"F4", "F6_E2M3", "F6_E3M2"})

#: torch dtype -> safetensors dtype name.
SAFETENSORS_NAMES: dict[torch.dtype, str] = {v: k for k, v in TORCH_DTYPES.items()}

#: dtypes a ``dtype`` recipe casts; integer, bool, complex and fp8 tensors are left as
#: stored (casting them would lose information).
CASTABLE = frozenset({"BF16", "F16", "F32", "F64"})


def itemsize(dtype: str) -> int:
    """Bytes per element of a safetensors dtype name.

    Raises:
        KeyError: the name is not a supported safetensors dtype.
    """
    return TORCH_DTYPES[dtype].itemsize

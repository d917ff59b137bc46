"""Processing recipes: what is done to each tensor between the file and the arena.

The same code runs in the daemon (before pinning) and in the worker (on the disk path), so
the two give the same bytes. A recipe first *plans* every tensor from the header alone (the
daemon sizes the arena before reading any data), then *applies* itself tensor by tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from weightcache._checkpoint import TensorInfo
from weightcache._dtypes import CASTABLE, TORCH_DTYPES
from weightcache._errors import RecipeError

RECIPE_NAME = "weightcache.dtype"
RECIPE_VERSION = 1


@dataclass(frozen=True)
class TensorSpec:
    """A tensor as it will be held: safetensors dtype name and shape."""

    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Placement:
    """Where the weights run: tensor-parallel rank ``tp_rank`` of ``tp_size``.

    Raises:
        RecipeError: ``tp_size < 1`` or ``tp_rank`` outside ``[0, tp_size)``.
    """

    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise RecipeError(f"invalid placement: tp_rank={self.tp_rank} tp_size={self.tp_size}")

    def identity(self) -> dict[str, Any]:
        """The placement's part of the fingerprint."""
        return {"tp_rank": self.tp_rank, "tp_size": self.tp_size}


@dataclass(frozen=True)
class Recipe:
    """Cast floating tensors to ``dtype`` (a safetensors name); ``None`` keeps them as stored.

    Integer, bool and fp8 tensors are never cast: a cast would change their meaning.

    Raises:
        RecipeError: ``dtype`` is not one of ``BF16``, ``F16``, ``F32``, ``F64``.
    """

    dtype: str | None = None

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in CASTABLE:
            raise RecipeError(
                f"unsupported recipe dtype {self.dtype!r}; use one of {sorted(CASTABLE)}"
            )

    def identity(self) -> dict[str, Any]:
        """The recipe's part of the fingerprint: name, version and parameters."""
        return {"name": RECIPE_NAME, "version": RECIPE_VERSION, "params": {"dtype": self.dtype}}

    def plan(self, info: TensorInfo) -> TensorSpec:
        """The dtype and shape ``info`` will have once processed (from the header only)."""
        return TensorSpec(self._target(info.dtype), info.shape)

    def passthrough(self, info: TensorInfo) -> bool:
        """Whether the recipe leaves ``info`` as stored (its bytes can be copied as they are)."""
        return self._target(info.dtype) == info.dtype

    def apply(self, info: TensorInfo, tensor: torch.Tensor) -> torch.Tensor:
        """Process one tensor read from the checkpoint; returns it unchanged when no cast."""
        target = self._target(info.dtype)
        if target == info.dtype:
            return tensor
        return tensor.to(TORCH_DTYPES[target])

    def _target(self, dtype: str) -> str:
        if self.dtype is None or dtype not in CASTABLE:
            return dtype
        return self.dtype


def parse_dtype(value: str | torch.dtype | None) -> str | None:
    """Normalise a dtype given as a safetensors name, a torch dtype or a short alias.

    Accepts ``"BF16"``/``"bf16"``/``"bfloat16"``/``torch.bfloat16`` and the like.

    Raises:
        RecipeError: the value names no supported floating dtype.
    """
    if value is None:
        return None
    if isinstance(value, torch.dtype):
        for name, dtype in TORCH_DTYPES.items():
            if dtype == value and name in CASTABLE:
                return name
        raise RecipeError(f"unsupported recipe dtype {value}")
    aliases = {
        "bfloat16": "BF16",
        "float16": "F16",
        "half": "F16",
        "float32": "F32",
        "float": "F32",
        "float64": "F64",
    }
    name = aliases.get(value.lower(), value.upper())
    if name not in CASTABLE:
        raise RecipeError(f"unsupported recipe dtype {value!r}; use one of {sorted(CASTABLE)}")
    return name

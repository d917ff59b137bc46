"""Where the weights run: :class:`Placement`, a tensor-parallel rank of a size.

A module of its own, importing nothing else of the package but the errors, so that the
recipe plugins (:mod:`weightcache.core.plugins`) name it without importing
:mod:`weightcache.core.recipe`, which imports them (issue 39: the import circle).
:mod:`weightcache.core.recipe` re-exports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from weightcache.core.errors import RecipeError


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

"""Tensor-parallel plans: which tensors are split for rank ``r`` of ``n``, and how.

Styles, as in Megatron-LM and the ``base_model_tp_plan`` of Hugging Face ``transformers``
configs (``transformers.integrations.tensor_parallel``):

- ``colwise``: split dim 0 (the output features of a linear weight, and its bias);
- ``rowwise``: split dim 1 of a 2-D weight (its input features); its bias is replicated;
- ``replicate``: every rank holds the whole tensor.

Rules are glob patterns over module names (``layers.*.self_attn.q_proj``, matched against
the tensor name without its last component, at any prefix such as ``model.``) or over whole
tensor names. The first matching rule wins; a tensor no rule matches is replicated.
"""

from __future__ import annotations

import fnmatch
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weightcache._errors import RecipeError
from weightcache._pipeline import Node, TensorSpec

STYLES = ("colwise", "rowwise", "replicate")
# transformers' variants that place the same bytes on a rank as the plain style.
_ALIASES = {
    "colwise": "colwise",
    "colwise_rep": "colwise",
    "local_colwise": "colwise",
    "rowwise": "rowwise",
    "rowwise_rep": "rowwise",
    "local_rowwise": "rowwise",
    "replicate": "replicate",
    "local": "replicate",
    "sequence_parallel": "replicate",
}


@dataclass(frozen=True)
class TPPlan:
    """An ordered list of ``(pattern, style)`` rules.

    Raises:
        RecipeError: a style is not one of ``colwise``, ``rowwise``, ``replicate`` or a
            transformers alias of them.
    """

    rules: tuple[tuple[str, str], ...]

    def __post_init__(self) -> None:
        for pattern, style in self.rules:
            if style not in STYLES:
                raise RecipeError(f"tensor-parallel rule {pattern!r}: unsupported style {style!r}")

    @classmethod
    def from_mapping(cls, plan: Mapping[str, str]) -> TPPlan:
        """Build from ``{pattern: style}``, mapping transformers' aliases to the three styles.

        Raises:
            RecipeError: a style has no equivalent here (e.g. ``packed_colwise``).
        """
        rules = []
        for pattern, style in plan.items():
            if style not in _ALIASES:
                raise RecipeError(f"tensor-parallel rule {pattern!r}: unsupported style {style!r}")
            rules.append((pattern, _ALIASES[style]))
        return cls(tuple(rules))

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> TPPlan:
        """Read a plan file: ``{pattern: style}``, or ``{"tp_plan": {pattern: style}}``.

        Raises:
            RecipeError: the file is unreadable or not such an object.
        """
        try:
            doc = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise RecipeError(f"cannot read tensor-parallel plan {path}: {exc}") from None
        plan = doc.get("tp_plan", doc) if isinstance(doc, dict) else None
        if not isinstance(plan, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in plan.items()
        ):
            raise RecipeError(f"{path}: a plan maps glob patterns to styles")
        return cls.from_mapping(plan)

    @classmethod
    def from_transformers(cls, checkpoint_root: str | os.PathLike[str]) -> TPPlan:
        """The ``base_model_tp_plan`` of the config class of the checkpoint's ``model_type``.

        Raises:
            RecipeError: no ``config.json`` with a ``model_type``; transformers is not
                installed or does not know the type; the class has no plan.
        """
        try:
            config = json.loads((Path(checkpoint_root) / "config.json").read_text())
            model_type = config["model_type"]
        except (OSError, ValueError, KeyError, TypeError):
            raise RecipeError(
                f"{checkpoint_root}: no config.json with a model_type; give a tensor-parallel "
                "plan (--tp-plan FILE, or Recipe(tp_plan=...))"
            ) from None
        try:
            from transformers import AutoConfig
        except ImportError:
            raise RecipeError("transformers is not installed; give a plan file") from None
        try:
            config_class = type(AutoConfig.for_model(model_type))
        except ValueError:
            raise RecipeError(f"transformers does not know model_type {model_type!r}") from None
        plan = getattr(config_class, "base_model_tp_plan", None)
        if not plan:
            raise RecipeError(
                f"{config_class.__name__} has no base_model_tp_plan; give a tensor-parallel "
                "plan (--tp-plan FILE, or Recipe(tp_plan=...))"
            )
        return cls.from_mapping(plan)

    def identity(self) -> list[list[str]]:
        """The plan's part of the fingerprint."""
        return [[pattern, style] for pattern, style in self.rules]

    def style_for(self, name: str) -> str:
        """The style of tensor ``name`` (``replicate`` when no rule matches)."""
        module = name.rpartition(".")[0]
        for pattern, style in self.rules:
            if (
                fnmatch.fnmatchcase(name, pattern)
                or fnmatch.fnmatchcase(module, pattern)
                or fnmatch.fnmatchcase(module, "*." + pattern)
            ):
                return style
        return "replicate"


def shard_nodes(nodes: dict[str, Node], plan: TPPlan, rank: int, size: int) -> dict[str, Node]:
    """The nodes rank ``rank`` of ``size`` holds.

    Raises:
        RecipeError: a split dimension is not divisible by ``size``; names the tensor.
    """
    if size == 1:
        return nodes
    return {
        name: _shard(name, node, plan.style_for(name), rank, size) for name, node in nodes.items()
    }


def _shard(name: str, node: Node, style: str, rank: int, size: int) -> Node:
    shape = node.spec.shape
    dim = _split_dim(style, shape)
    if dim is None:
        return node
    if shape[dim] % size:
        raise RecipeError(
            f"tensor {name!r}: dim {dim} of size {shape[dim]} is not divisible by tp_size {size}"
        )
    part = shape[dim] // size
    new_shape = (*shape[:dim], part, *shape[dim + 1 :])
    spec = TensorSpec(node.spec.dtype, new_shape)

    def narrow(tensor: Any) -> Any:
        return tensor.narrow(dim, rank * part, part)

    return node.derive(spec, narrow)


def _split_dim(style: str, shape: tuple[int, ...]) -> int | None:
    if style == "colwise" and len(shape) >= 1:
        return 0
    if style == "rowwise" and len(shape) == 2:
        return 1
    return None

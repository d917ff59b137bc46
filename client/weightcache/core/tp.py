"""Tensor-parallel plans: which tensors are split for rank ``r`` of ``n``, and how.

Styles, as in Megatron-LM and the ``base_model_tp_plan`` of Hugging Face ``transformers``
configs (``transformers.integrations.tensor_parallel``):

- ``colwise``: split dim 0 (the output features of a linear weight, and its bias);
- ``rowwise``: split dim 1 of a 2-D weight (its input features); its bias is replicated;
- ``replicate``: every rank holds the whole tensor.

Rules are glob patterns over module names (``layers.*.self_attn.q_proj``, matched against
the tensor name without its last component, at any prefix such as ``model.``) or over whole
tensor names. The first matching rule wins; a tensor no rule matches is replicated.

A plan comes over the wire in a remote Preload, so its size is bounded (:data:`MAX_RULES`,
:data:`MAX_PATTERN_CHARS`, :data:`MAX_PLAN_CHARS`) and each pattern is compiled once per plan
with ``fnmatch.translate``, not through ``fnmatch.fnmatchcase``, whose process-wide cache keeps
up to 32768 compiled patterns alive after the plan is gone.
"""

from __future__ import annotations

import fnmatch
import functools
import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weightcache.core import sidefiles
from weightcache.core.errors import RecipeError
from weightcache.core.pipeline import Node, TensorSpec

STYLES = ("colwise", "rowwise", "replicate")
#: Most rules in one plan (transformers' largest ``base_model_tp_plan`` has a few dozen).
MAX_RULES = 256
#: Longest pattern, in characters.
MAX_PATTERN_CHARS = 256
#: Most pattern characters in one plan, all rules together.
MAX_PLAN_CHARS = 4096
#: Every style transformers' ``ParallelInterface`` registers (``ALL_PARALLEL_STYLES`` in
#: ``transformers.distributed.tensor_parallel``, 5.x), and older names, mapped to the style
#: here whose rank holds the same bytes of each parameter: their forward hooks (where
#: activations are gathered, reduced or split) differ, and those are the engine's business.
#: Checked against transformers' own ``shard_param`` in ``tests/test_tp_plans.py``. Not
#: here, so refused: the styles of :data:`REFUSED_STYLES` (each with its reason) and any
#: unknown name.
TRANSFORMERS_STYLES = {
    # weight and bias: Shard(0) (a 2-D weight's output features).
    "colwise": "colwise",
    "colwise_rep": "colwise",
    "colwise_gather_output": "colwise",
    "local_colwise": "colwise",
    # an embedding's 2-D weight: Shard(0), its vocabulary.
    "embedding_rowwise": "colwise",
    # weight: Shard(-1) (a 2-D weight's input features); bias replicated.
    "rowwise": "rowwise",
    "rowwise_rep": "rowwise",
    "rowwise_split_input": "rowwise",
    "local_rowwise": "rowwise",
    # an embedding's 2-D weight: Shard(1), its hidden dimension.
    "embedding_colwise": "rowwise",
    # every rank holds the whole parameter.
    "replicate": "replicate",
    "local": "replicate",
    "sequence_parallel": "replicate",
    # forward hooks only (no ``shard_param``): see FORWARD_ONLY_STYLES.
    "replicated_with_grad_allreduce": "replicate",
    "all_reduce": "replicate",
    "mla_kv_a_proj": "replicate",
    "moe_tp_experts": "replicate",
    "moe_identity_expert": "replicate",
    "local_params": "replicate",
}
#: transformers styles that shard no parameter: transformers applies them to a module's
#: forward, while the parameters under it follow their own rules. :meth:`TPPlan.from_mapping`
#: moves their rules after every other one, so that they never shadow a parameter's rule.
FORWARD_ONLY_STYLES = frozenset(
    {
        "replicated_with_grad_allreduce",
        "all_reduce",
        "mla_kv_a_proj",
        "moe_tp_experts",
        "moe_identity_expert",
        "local_params",
    }
)
#: transformers styles refused on purpose, with the reason: a rank of theirs does not hold one
#: contiguous ``1/tp_size`` block of each parameter, which is all a rule here can express.
REFUSED_STYLES = {
    "packed_colwise": "interleaved _StridedShard slices, not one contiguous block per rank",
    "packed_rowwise": "interleaved _StridedShard slices, not one contiguous block per rank",
    # transformers 5.25 (UnitColwiseParallel, UnitRowwiseParallel): whole heads on a "unit
    # mesh" whose shape comes from the head count and the world size, with heads replicated
    # when there are fewer than ranks.
    "unit_colwise": "whole attention heads on a unit mesh, replicated when the heads are "
    "fewer than the ranks: the bytes of a rank depend on the head count",
    "unit_rowwise": "whole attention heads on a unit mesh, replicated when the heads are "
    "fewer than the ranks: the bytes of a rank depend on the head count",
}


@dataclass(frozen=True)
class TPPlan:
    """An ordered list of ``(pattern, style)`` rules.

    Raises:
        RecipeError: a style is not one of ``colwise``, ``rowwise``, ``replicate`` or a
            transformers alias of them; the plan is over :data:`MAX_RULES` rules, a pattern
            over :data:`MAX_PATTERN_CHARS` characters, or all patterns together over
            :data:`MAX_PLAN_CHARS`.
    """

    rules: tuple[tuple[str, str], ...]

    def __post_init__(self) -> None:
        problem = over_bounds(pattern for pattern, _ in self.rules)
        if problem is not None:
            raise RecipeError(f"tensor-parallel plan: {problem}")
        for pattern, style in self.rules:
            if style not in STYLES:
                raise RecipeError(f"tensor-parallel rule {pattern!r}: unsupported style {style!r}")

    @classmethod
    def from_mapping(cls, plan: Mapping[str, str]) -> TPPlan:
        """Build from ``{pattern: style}``, mapping transformers' style names
        (:data:`TRANSFORMERS_STYLES`) to the three styles; rules of a forward-only style
        (:data:`FORWARD_ONLY_STYLES`) go last, in their order.

        Raises:
            RecipeError: a style has no equivalent here: one of :data:`REFUSED_STYLES` (the
                message gives its reason) or an unknown name.
        """
        rules: list[tuple[str, str]] = []
        forward_only: list[tuple[str, str]] = []
        for pattern, style in plan.items():
            if style in REFUSED_STYLES:
                raise RecipeError(
                    f"tensor-parallel rule {pattern!r}: unsupported style {style!r} "
                    f"({REFUSED_STYLES[style]})"
                )
            if style not in TRANSFORMERS_STYLES:
                raise RecipeError(f"tensor-parallel rule {pattern!r}: unsupported style {style!r}")
            rule = (pattern, TRANSFORMERS_STYLES[style])
            (forward_only if style in FORWARD_ONLY_STYLES else rules).append(rule)
        return cls(tuple(rules + forward_only))

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
            InvalidCheckpointError: ``config.json`` is not a small regular file inside
                the checkpoint (:func:`weightcache.core.sidefiles.read_bytes`).
        """
        raw = sidefiles.read_bytes(checkpoint_root, "config.json")
        try:
            model_type = json.loads(raw)["model_type"] if raw is not None else None
        except (ValueError, KeyError, TypeError):
            model_type = None
        if not isinstance(model_type, str):
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
        for whole, module_at_any_prefix, style in self._compiled:
            if whole.match(name) or module_at_any_prefix.match(module):
                return style
        return "replicate"

    @functools.cached_property
    def _compiled(self) -> tuple[tuple[re.Pattern[str], re.Pattern[str], str], ...]:
        # fnmatchcase(s, p) is translate(p) matched at the start of s; "p or *.p" on the
        # module is one pattern, "(?s:.*\.)?" before p. Compiled once per plan, on first use
        # (in the loading thread, not on the daemon's event loop).
        return tuple(
            (
                re.compile(fnmatch.translate(pattern)),
                re.compile(r"(?s:.*\.)?" + fnmatch.translate(pattern)),
                style,
            )
            for pattern, style in self.rules
        )


def over_bounds(patterns: Iterable[str]) -> str | None:
    """Why a plan with these patterns is too large to accept, or ``None`` if it is not.

    The bounds keep compiling and matching a plan to milliseconds (a remote Preload carries
    the plan): at most :data:`MAX_RULES` patterns of at most :data:`MAX_PATTERN_CHARS`
    characters, :data:`MAX_PLAN_CHARS` in all.
    """
    total = 0
    for count, pattern in enumerate(patterns, start=1):
        total += len(pattern)
        if count > MAX_RULES:
            return f"over {MAX_RULES} rules"
        if len(pattern) > MAX_PATTERN_CHARS:
            return (
                f"a pattern of {len(pattern)} characters is over the limit of {MAX_PATTERN_CHARS}"
            )
        if total > MAX_PLAN_CHARS:
            return f"the patterns together are over {MAX_PLAN_CHARS} characters"
    return None


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


#: Projections whose output rows are attention heads, by module name, and the config key
#: that counts those heads (as transformers' ``get_kv_heads_per_rank`` finds them).
HEAD_PROJECTIONS = {
    "q_proj": ("num_attention_heads",),
    "k_proj": ("num_key_value_heads", "num_attention_heads"),
    "v_proj": ("num_key_value_heads", "num_attention_heads"),
    "qkv_proj": ("num_key_value_heads", "num_attention_heads"),
    "query_key_value": ("num_key_value_heads", "num_attention_heads"),
}


def check_heads(plan: TPPlan, config: Mapping[str, Any], size: int) -> None:
    """Refuse a plan that would split an attention head across ranks.

    A ``colwise`` rule on a head projection (:data:`HEAD_PROJECTIONS`: ``k_proj``,
    ``v_proj``, ...) splits its rows, which are heads of ``head_dim`` rows each: with
    ``tp_size`` above ``num_key_value_heads`` (grouped-query attention), or not dividing it,
    a rank would hold part of a head, which no engine computes with (transformers#48307).
    Refused, as torchtitan does (vLLM instead replicates KV heads, a choice of its own
    engine's weight loader); a plan that replicates the projection is accepted.

    Args:
        plan: the resolved plan.
        config: the checkpoint's ``config.json`` (its ``text_config`` is read when the
            counts are not at the top).
        size: ``tp_size``.

    Raises:
        RecipeError: ``size`` does not divide a head count; names the projection rule, the
            config key and the count.
    """
    counts = config.get("text_config") if "num_attention_heads" not in config else config
    if not isinstance(counts, Mapping):
        return
    for pattern, style in plan.rules:
        if style != "colwise":
            continue
        module = pattern.removesuffix(".weight").removesuffix(".bias").rpartition(".")[2]
        for key in HEAD_PROJECTIONS.get(module, ()):
            heads = counts.get(key)
            if isinstance(heads, int) and not isinstance(heads, bool) and heads > 0:
                if heads % size:
                    raise RecipeError(
                        f"tensor-parallel rule {pattern!r} (colwise) would split the model's "
                        f"{heads} attention heads ({key}={heads} in config.json) across "
                        f"tp_size {size} ranks; use a tp_size that divides {heads}, or a plan "
                        f"that replicates {module}"
                    )
                break

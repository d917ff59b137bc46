"""Processing recipes: what is done to the stored tensors before they are held.

A recipe runs three stages, in this order, on the graph of :mod:`weightcache.core.pipeline`:

1. tensor-parallel sharding for the placement (when ``tp_size > 1``; :mod:`weightcache.core.tp`);
2. plugins, in the order given (:mod:`weightcache.core.plugins`), on the rank's shards;
3. a ``dtype`` cast of floating tensors; integer, bool, complex and fp8 tensors are never
   cast.

The same code runs in the daemon and in the worker's disk path, so both give the same bytes.

A recipe whose one step is a model plugin (:class:`~weightcache.core.plugins.ModelPlugin`,
such as ``vllm``) runs none of these stages: the plugin builds every held tensor from the
whole checkpoint and the placement, with the step's parameters as it resolves them.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from weightcache.core import dtypes, sidefiles
from weightcache.core.checkpoint import Checkpoint
from weightcache.core.dtypes import CASTABLE
from weightcache.core.errors import RecipeError
from weightcache.core.pipeline import Node, TensorSpec, stored_nodes
from weightcache.core.placement import Placement
from weightcache.core.plugins import ModelPlugin, PluginStep, RecipePlugin
from weightcache.core.tp import TPPlan, check_heads, shard_nodes

#: ``Placement`` lives in :mod:`weightcache.core.placement` (imported by the plugins
#: without this module) and stays importable from here.
__all__ = [
    "RECIPE_NAME",
    "RECIPE_VERSION",
    "Pipeline",
    "Placement",
    "Recipe",
    "parse_dtype",
]

if TYPE_CHECKING:
    import torch

RECIPE_NAME = "weightcache.recipe"
RECIPE_VERSION = 2


@dataclass(frozen=True)
class Recipe:
    """The processing applied before weights are held.

    Attributes:
        dtype: cast floating tensors to this safetensors dtype; None keeps them.
        tp_plan: tensor-parallel rules; None takes the ``base_model_tp_plan`` of the
            checkpoint's transformers config when ``tp_size > 1``.
        plugins: plugin steps, applied in order.

    Raises:
        RecipeError: ``dtype`` is not one of ``BF16``, ``F16``, ``F32``, ``F64``.
    """

    dtype: str | None = None
    tp_plan: TPPlan | None = None
    plugins: tuple[PluginStep, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in CASTABLE:
            raise RecipeError(
                f"unsupported recipe dtype {self.dtype!r}; use one of {sorted(CASTABLE)}"
            )

    def build(self, checkpoint: Checkpoint, placement: Placement) -> Pipeline:
        """Resolve the plan and plugins for a checkpoint and plan every output tensor.

        Raises:
            RecipeError: no plan can be found for ``tp_size > 1``; a split dimension is
                not divisible; a plugin is missing or fails to plan.
        """
        plan, plugins = self._resolve(checkpoint.root, placement)
        if plugins and isinstance(plugins[0][1], ModelPlugin):
            step, plugin = plugins[0]
            nodes = _build_model(plugin, step, checkpoint, placement)
            return Pipeline(nodes=nodes, identity=self._identity(plan, plugins))
        nodes = stored_nodes(checkpoint)
        if plan is not None:
            nodes = shard_nodes(nodes, plan, placement.tp_rank, placement.tp_size)
        for step, plugin in plugins:
            assert isinstance(plugin, RecipePlugin)  # _resolve allows no other with a model plugin
            try:
                nodes = plugin.transform(nodes, dict(step.params))
            except Exception as exc:
                # Plugin code is not ours: whatever it raises, the recipe cannot apply.
                raise RecipeError(
                    f"recipe plugin {step.name!r} failed: {type(exc).__name__}: {exc}"
                ) from None
        if self.dtype is not None:
            nodes = {name: _cast(node, self.dtype) for name, node in nodes.items()}
        return Pipeline(nodes=nodes, identity=self._identity(plan, plugins))

    def identity(self, root: Path, placement: Placement) -> dict[str, Any]:
        """The recipe's part of the fingerprint for the checkpoint folder ``root``, without
        reading its tensors: what :meth:`build` would give as ``Pipeline.identity``. Only
        the transformers ``config.json`` is read, for a plan that is not given.

        Raises:
            RecipeError: no plan can be found for ``tp_size > 1``; a plugin is missing.
        """
        return self._identity(*self._resolve(root, placement))

    def builds_model(self) -> bool:
        """Whether a plugin of the recipe builds every held tensor itself (a
        :class:`~weightcache.core.plugins.ModelPlugin`, whose :meth:`build` runs an
        engine): then :meth:`identity` is the cheap way to its fingerprint.

        Raises:
            RecipeError: a plugin is missing.
        """
        return any(isinstance(step.load(), ModelPlugin) for step in self.plugins)

    def _resolve(self, root: Path, placement: Placement) -> tuple[TPPlan | None, list[_Step]]:
        plugins = [(step, step.load()) for step in self.plugins]
        # An empty plan means "not given", on the wire and here alike.
        has_rules = self.tp_plan is not None and bool(self.tp_plan.rules)
        if any(isinstance(plugin, ModelPlugin) for _, plugin in plugins):
            return None, [_model_step(plugins, self.dtype, has_rules, root, placement)]
        plan = None
        if placement.tp_size > 1:
            plan = self.tp_plan if has_rules else TPPlan.from_transformers(root)
            if plan is not None:
                check_heads(plan, _config(root), placement.tp_size)
        return plan, plugins

    def _identity(self, plan: TPPlan | None, plugins: list[_Step]) -> dict[str, Any]:
        steps = [
            {"name": step.name, "version": plugin.version, "params": step.params}
            for step, plugin in plugins
        ]
        return {
            "name": RECIPE_NAME,
            "version": RECIPE_VERSION,
            "dtype": self.dtype,
            "tp_plan": plan.identity() if plan is not None else None,
            "plugins": steps,
        }


_Step = tuple[PluginStep, RecipePlugin | ModelPlugin]


def _model_step(
    plugins: list[_Step], dtype: str | None, has_rules: bool, root: Path, placement: Placement
) -> _Step:
    """The one step of a recipe whose plugin builds the model, its parameters resolved."""
    if len(plugins) != 1 or dtype is not None or has_rules:
        names = ", ".join(step.name for step, _ in plugins)
        raise RecipeError(
            f"recipe plugins {names}: a plugin that builds the model itself ({names}) must be "
            "the recipe's only step, without dtype or tp_plan (give them as its parameters)"
        )
    step, plugin = plugins[0]
    assert isinstance(plugin, ModelPlugin)
    with _plugin_code(step):
        params = plugin.resolve(root, placement, dict(step.params))
    return PluginStep(step.name, params), plugin


def _build_model(
    plugin: RecipePlugin | ModelPlugin,
    step: PluginStep,
    checkpoint: Checkpoint,
    placement: Placement,
) -> dict[str, Node]:
    assert isinstance(plugin, ModelPlugin)
    with _plugin_code(step):
        nodes = plugin.build_model(checkpoint, placement, dict(step.params))
    return nodes


@contextlib.contextmanager
def _plugin_code(step: PluginStep) -> Iterator[None]:
    """Run a model plugin's code: its RecipeError as it is, anything else as one."""
    try:
        yield
    except RecipeError:
        raise
    except Exception as exc:
        # Plugin code is not ours: whatever it raises, the recipe cannot apply.
        raise RecipeError(
            f"recipe plugin {step.name!r} failed: {type(exc).__name__}: {exc}"
        ) from None


@dataclass(frozen=True)
class Pipeline:
    """A recipe resolved for one checkpoint and placement.

    Attributes:
        nodes: output name -> node, in output order.
        identity: the recipe's part of the fingerprint (resolved plan, plugin versions).
    """

    nodes: dict[str, Node]
    identity: dict[str, Any]

    def resolved(self) -> Recipe:
        """The recipe as it was applied: the tensor-parallel plan found (given or from the
        checkpoint's config) and the plugin steps; what a daemon reports for a model."""
        plan = self.identity["tp_plan"]
        return Recipe(
            dtype=self.identity["dtype"],
            tp_plan=TPPlan(tuple((pattern, style) for pattern, style in plan)) if plan else None,
            plugins=tuple(
                PluginStep(step["name"], tuple(step["params"]), step["version"])
                for step in self.identity["plugins"]
            ),
        )


def _config(root: Path) -> dict[str, Any]:
    """The checkpoint's transformers ``config.json``, or ``{}`` when it has none, or not
    JSON, or not a JSON object (the plan given is then all there is to check).

    Raises:
        InvalidCheckpointError: it is not a small regular file inside the checkpoint
            (:func:`weightcache.core.sidefiles.read_bytes`).
    """
    raw = sidefiles.read_bytes(root, "config.json")
    try:
        config = json.loads(raw) if raw is not None else {}
    except ValueError:
        return {}
    return config if isinstance(config, dict) else {}


def _cast(node: Node, dtype: str) -> Node:
    if node.spec.dtype not in CASTABLE or node.spec.dtype == dtype:
        return node
    # The torch dtype is looked up when the node is computed, not when it is planned: a
    # recipe's identity and plan import no torch (issue 39).
    return node.derive(
        TensorSpec(dtype, node.spec.shape), lambda t: t.to(dtypes.TORCH_DTYPES[dtype])
    )


def parse_dtype(value: str | torch.dtype | None) -> str | None:
    """Normalise a dtype given as a safetensors name, a torch dtype or a short alias.

    Accepts ``"BF16"``/``"bf16"``/``"bfloat16"``/``torch.bfloat16`` and the like.

    Raises:
        RecipeError: the value names no supported floating dtype.
    """
    if value is None:
        return None
    if not isinstance(value, str):
        # Only a caller holding a torch dtype gets here, so torch is already imported.
        for name, dtype in dtypes.TORCH_DTYPES.items():
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

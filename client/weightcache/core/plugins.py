"""Recipe plugins: operator-installed transforms found through a Python entry-point group.

A distribution registers a plugin under the ``weightcache.recipes`` group (PyPA entry
points specification); the entry point names a class or an object with:

- ``name: str`` and ``version: str`` (both enter the fingerprint, with the parameters);
- ``transform(nodes: dict[str, Node], params: Mapping[str, str]) -> dict[str, Node]``:
  returns the new set of nodes, planned from specs alone (see :mod:`weightcache.core.pipeline`);
  e.g. a QKV fusion replaces three nodes by one whose ``compute`` concatenates them.

The same plugin code runs in the daemon and in the worker's disk path.

A *model plugin* (:class:`ModelPlugin`) instead builds the held tensors from the whole
checkpoint with an engine of its own (the vLLM recipe,
:mod:`weightcache.integrations.vllm.recipe`): it has ``resolve`` and ``build_model``
instead of ``transform``, and is the recipe's only step (no plan, plugin or dtype beside
it): the engine it runs shards, fuses and casts by its own rules.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from weightcache.core.errors import RecipeError
from weightcache.core.pipeline import Node

if TYPE_CHECKING:
    from weightcache.core.checkpoint import Checkpoint
    from weightcache.core.placement import Placement

ENTRY_POINT_GROUP = "weightcache.recipes"


@runtime_checkable
class RecipePlugin(Protocol):
    """What a ``weightcache.recipes`` entry point provides."""

    name: str
    version: str

    def transform(self, nodes: dict[str, Node], params: Mapping[str, str]) -> dict[str, Node]:
        """The nodes after this step."""


@runtime_checkable
class ModelPlugin(Protocol):
    """What a ``weightcache.recipes`` entry point provides that builds the model itself."""

    name: str
    version: str

    def resolve(
        self, root: Path, placement: Placement, params: Mapping[str, str]
    ) -> tuple[tuple[str, str], ...]:
        """The step's parameters as they enter the fingerprint: defaults filled in from the
        checkpoint folder ``root`` (read without its tensors) and ``placement``, sorted.

        Raises:
            RecipeError: an unknown or invalid parameter, or a placement not supported.
        """

    def build_model(
        self, checkpoint: Checkpoint, placement: Placement, params: Mapping[str, str]
    ) -> dict[str, Node]:
        """Every held tensor, by name, from the whole checkpoint (``params`` resolved).

        Raises:
            RecipeError: the engine could not build the model.
        """


@dataclass(frozen=True)
class PluginStep:
    """One plugin applied with parameters (string to string).

    Attributes:
        version: the version of the plugin applied, in a recipe as a daemon reports it
            (``Pipeline.resolved``); empty in a requested recipe, where the installed
            plugin decides. Not compared: the step is its name and parameters.
    """

    name: str
    params: tuple[tuple[str, str], ...] = ()
    version: str = field(default="", compare=False)

    @classmethod
    def parse(cls, text: str) -> PluginStep:
        """Parse ``NAME[:k=v,...]`` as given to ``--recipe``. A value that starts with
        ``{`` or ``[`` is one JSON value (RFC 8259), commas included:
        ``vllm:hf_overrides={"rope_theta":1000000.0,"max_position_embeddings":512}``.

        Raises:
            RecipeError: an empty name, a parameter without ``=``, or a value that starts
                as JSON and is not one JSON value followed by ``,`` or the end.
        """
        name, _, rest = text.partition(":")
        if not name:
            raise RecipeError(f"recipe {text!r}: no name")
        return cls(name, tuple(sorted(_params(text, rest))))

    def load(self) -> RecipePlugin | ModelPlugin:
        """The installed plugin for this step.

        Raises:
            RecipeError: no entry point of that name, or it provides neither protocol.
        """
        from importlib import metadata  # 30-60 ms: only when a recipe names a plugin

        found = metadata.entry_points(group=ENTRY_POINT_GROUP, name=self.name)
        if not found:
            raise RecipeError(f"no recipe plugin {self.name!r} is installed ({ENTRY_POINT_GROUP})")
        obj: Any = next(iter(found)).load()
        plugin = obj() if isinstance(obj, type) else obj
        if not isinstance(plugin, RecipePlugin | ModelPlugin):
            raise RecipeError(
                f"recipe plugin {self.name!r} lacks name, version, and transform or "
                "resolve and build_model"
            )
        if plugin.name != self.name:
            raise RecipeError(
                f"entry point {self.name!r} provides a plugin named {plugin.name!r}; "
                "the two must agree (the name is what operators allow and fingerprints hold)"
            )
        return plugin


def _params(text: str, rest: str) -> list[tuple[str, str]]:
    """The ``k=v`` items of ``rest`` (``text`` after its ``NAME:``), split at commas
    outside JSON values."""
    params = []
    at = 0
    while at < len(rest):
        comma = rest.find(",", at)
        end = len(rest) if comma < 0 else comma
        key, sep, _ = rest[at:end].partition("=")
        if at == end:  # an empty item, as in "a=1,,b=2"
            at += 1
            continue
        if not sep or not key:
            raise RecipeError(f"recipe {text!r}: parameter {rest[at:end]!r} is not k=v")
        start = at + len(key) + 1
        if rest.startswith(("{", "["), start):
            end = _json_end(text, key, rest, start)
        params.append((key, rest[start:end]))
        at = end + 1
    return params


def _json_end(text: str, key: str, rest: str, start: int) -> int:
    try:
        _, end = json.JSONDecoder().raw_decode(rest, start)
    except json.JSONDecodeError as err:
        raise RecipeError(f"recipe {text!r}: parameter {key!r} is not JSON: {err}") from None
    if end < len(rest) and rest[end] != ",":
        raise RecipeError(
            f"recipe {text!r}: parameter {key!r}: {rest[end:]!r} follows its JSON value"
        )
    return end

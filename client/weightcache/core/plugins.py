"""Recipe plugins: operator-installed transforms found through a Python entry-point group.

A distribution registers a plugin under the ``weightcache.recipes`` group (PyPA entry
points specification); the entry point names a class or an object with:

- ``name: str`` and ``version: str`` (both enter the fingerprint, with the parameters);
- ``transform(nodes: dict[str, Node], params: Mapping[str, str]) -> dict[str, Node]``:
  returns the new set of nodes, planned from specs alone (see :mod:`weightcache.core.pipeline`);
  e.g. a QKV fusion replaces three nodes by one whose ``compute`` concatenates them.

The same plugin code runs in the daemon and in the worker's disk path.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Protocol, runtime_checkable

from weightcache.core.errors import RecipeError
from weightcache.core.pipeline import Node

ENTRY_POINT_GROUP = "weightcache.recipes"


@runtime_checkable
class RecipePlugin(Protocol):
    """What a ``weightcache.recipes`` entry point provides."""

    name: str
    version: str

    def transform(self, nodes: dict[str, Node], params: Mapping[str, str]) -> dict[str, Node]:
        """The nodes after this step."""


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
        """Parse ``NAME[:k=v,...]`` as given to ``--recipe``.

        Raises:
            RecipeError: an empty name, or a parameter without ``=``.
        """
        name, _, rest = text.partition(":")
        params = []
        for item in filter(None, rest.split(",")):
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise RecipeError(f"recipe {text!r}: parameter {item!r} is not k=v")
            params.append((key, value))
        if not name:
            raise RecipeError(f"recipe {text!r}: no name")
        return cls(name, tuple(sorted(params)))

    def load(self) -> RecipePlugin:
        """The installed plugin for this step.

        Raises:
            RecipeError: no entry point of that name, or it does not provide the protocol.
        """
        found = metadata.entry_points(group=ENTRY_POINT_GROUP, name=self.name)
        if not found:
            raise RecipeError(f"no recipe plugin {self.name!r} is installed ({ENTRY_POINT_GROUP})")
        obj: Any = next(iter(found)).load()
        plugin = obj() if isinstance(obj, type) else obj
        if not isinstance(plugin, RecipePlugin):
            raise RecipeError(f"recipe plugin {self.name!r} lacks name, version or transform")
        if plugin.name != self.name:
            raise RecipeError(
                f"entry point {self.name!r} provides a plugin named {plugin.name!r}; "
                "the two must agree (the name is what operators allow and fingerprints hold)"
            )
        return plugin

"""Example weightcache recipe plugins, registered in the ``weightcache.recipes`` group by
the ``weightcache_fuse_qkv-0.1.dist-info`` folder beside this file.

Put this folder on ``sys.path`` (``PYTHONPATH``) and ``importlib.metadata`` finds them:

- ``fuse_qkv``: every ``P.q_proj.W``, ``P.k_proj.W``, ``P.v_proj.W`` triple (``W`` being
  ``weight`` or ``bias``) becomes one ``P.<out>.W``, their concatenation along dim 0, in the
  place of ``q``; q, k and v are removed. Parameter ``out`` (default ``qkv_proj``).
- ``drop_tensors``: removes the tensors whose names match the glob ``pattern``.
- ``fail_at``: raises while the tensor named by parameter ``tensor`` is computed.

Both plan from specs alone: nothing is read until the daemon (or the disk path)
materialises the nodes.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping

import torch

from weightcache import Node, TensorSpec

PARTS = ("q_proj", "k_proj", "v_proj")


def _check_params(name: str, params: Mapping[str, str], allowed: set[str]) -> None:
    unknown = sorted(set(params) - allowed)
    if unknown:
        raise ValueError(f"{name}: unknown parameters {unknown}; it takes {sorted(allowed)}")


class FuseQKV:
    """Fuse q/k/v projections into one tensor (concatenated along dim 0)."""

    name = "fuse_qkv"
    version = "0.1"

    def transform(self, nodes: dict[str, Node], params: Mapping[str, str]) -> dict[str, Node]:
        _check_params(self.name, params, {"out"})
        out = params.get("out", "qkv_proj")
        fused: dict[str, _Named] = {}
        consumed: set[str] = set()
        for name in nodes:
            prefix, dot, leaf = name.rpartition(".")
            owner, _, module = prefix.rpartition(".")
            if not dot or module != "q_proj":
                continue
            base = f"{owner}." if owner else ""
            names = [f"{base}{part}.{leaf}" for part in PARTS]
            if not all(n in nodes for n in names):
                continue
            fused[name] = _concat(f"{base}{out}.{leaf}", [nodes[n] for n in names])
            consumed.update(names)
        result: dict[str, Node] = {}
        for name, node in nodes.items():
            if name in fused:
                target = fused[name]
                result[target.name] = target.node
            elif name not in consumed:
                result[name] = node
        return result


class _Named:
    def __init__(self, name: str, node: Node) -> None:
        self.name = name
        self.node = node


def _concat(name: str, parts: list[Node]) -> _Named:
    specs = [p.spec for p in parts]
    if len({s.dtype for s in specs}) != 1 or len({s.shape[1:] for s in specs}) != 1:
        raise ValueError(f"{name}: q, k and v differ in dtype or trailing dims: {specs}")
    if any(len(s.shape) == 0 for s in specs):
        raise ValueError(f"{name}: cannot concatenate 0-d tensors")
    rows = sum(s.shape[0] for s in specs)
    spec = TensorSpec(specs[0].dtype, (rows, *specs[0].shape[1:]))
    computes = [p.compute for p in parts]
    return _Named(name, Node(spec, lambda reader: torch.cat([c(reader) for c in computes], 0)))


class DropTensors:
    """Remove the tensors whose names match a glob."""

    name = "drop_tensors"
    version = "0.1"

    def transform(self, nodes: dict[str, Node], params: Mapping[str, str]) -> dict[str, Node]:
        _check_params(self.name, params, {"pattern"})
        pattern = params["pattern"]
        return {n: node for n, node in nodes.items() if not fnmatch.fnmatchcase(n, pattern)}


class FailAt:
    """Fail while the daemon computes one tensor (parameter ``tensor``): a plugin bug that
    shows only once loading has started, for the tests of failed loads."""

    name = "fail_at"
    version = "0.1"

    def transform(self, nodes: dict[str, Node], params: Mapping[str, str]) -> dict[str, Node]:
        _check_params(self.name, params, {"tensor"})
        target = params["tensor"]

        def fail(reader: object) -> torch.Tensor:
            raise RuntimeError(f"fail_at: planted failure in {target}")

        return {n: Node(node.spec, fail) if n == target else node for n, node in nodes.items()}

"""The processing graph: what each held tensor is computed from, planned from headers alone.

A :class:`Node` is one output tensor: its spec (dtype, shape) and how to compute it from
the checkpoint. Stages (tensor-parallel sharding, plugins, dtype cast) turn a dict of nodes
into another. The daemon sizes its arena from the specs before reading any data, then
computes one node at a time, so peak memory is the arena plus the inputs of one node.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from weightcache.core.checkpoint import Checkpoint, ShardReader, TensorInfo
from weightcache.core.dtypes import itemsize

if TYPE_CHECKING:
    # Only for annotations: planning (specs, sizes) needs no torch; computing a node that
    # is not a stored tensor (a cast, a shard, a plugin) imports it, in the code that runs.
    import torch


@dataclass(frozen=True)
class TensorSpec:
    """A tensor as it will be held: safetensors dtype name and shape."""

    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Size in bytes."""
        return math.prod(self.shape) * itemsize(self.dtype)


class CheckpointReader:
    """Reads stored tensors by name from the checkpoint's open shard files (a context
    manager; the files stay the checkpoint's to close).

    Raises:
        InvalidCheckpointError: the checkpoint is closed, or a shard ended early.
    """

    def __init__(self, checkpoint: Checkpoint) -> None:
        self._checkpoint = checkpoint
        self._shards = {shard.name: shard for shard in checkpoint.shards}
        self._readers: dict[str, ShardReader] = {}

    def _reader(self, info: TensorInfo) -> ShardReader:
        reader = self._readers.get(info.shard)
        if reader is None:
            shard = self._shards[info.shard]
            reader = ShardReader(shard, self._checkpoint.fd(shard.name))
            self._readers[info.shard] = reader
        return reader

    def read(self, info: TensorInfo) -> torch.Tensor:
        """A new tensor with the stored bytes of ``info``."""
        return self._reader(info).read(info)

    def read_into(self, info: TensorInfo, out: memoryview) -> None:
        """Write the stored bytes of ``info`` into ``out`` (exactly its size)."""
        self._reader(info).read_into(info, out)

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._readers.clear()


Compute = Callable[[CheckpointReader], "torch.Tensor"]


@dataclass(frozen=True)
class Node:
    """One output tensor.

    Attributes:
        spec: dtype and shape of the result.
        compute: builds the result from a reader (a new, contiguous tensor or a view).
        stored: the stored tensor this node is, unchanged; None once a stage changed it.
            Unchanged tensors are copied byte for byte without a temporary.
    """

    spec: TensorSpec
    compute: Compute
    stored: TensorInfo | None = None

    def derive(self, spec: TensorSpec, fn: Callable[[torch.Tensor], torch.Tensor]) -> Node:
        """A node computed by ``fn`` from this node's result."""
        parent = self.compute
        return Node(spec, lambda reader: fn(parent(reader)))


def stored_nodes(checkpoint: Checkpoint) -> dict[str, Node]:
    """One node per stored tensor, in checkpoint order."""
    return {
        name: Node(
            TensorSpec(info.dtype, info.shape),
            lambda reader, info=info: reader.read(info),  # type: ignore[misc]
            stored=info,
        )
        for name, info in checkpoint.tensors.items()
    }


def materialize(node: Node, reader: CheckpointReader) -> torch.Tensor:
    """Compute a node's tensor, checking it against the node's spec.

    Raises:
        RuntimeError: a stage produced a dtype or shape other than it planned (a plugin
            bug); the weights would be wrong, so nothing is kept.
    """
    from weightcache.core.dtypes import TORCH_DTYPES  # torch: the node computed a tensor

    tensor = node.compute(reader)
    expected = (TORCH_DTYPES[node.spec.dtype], node.spec.shape)
    if (tensor.dtype, tuple(tensor.shape)) != expected:
        raise RuntimeError(
            f"a recipe stage planned {expected} but produced {(tensor.dtype, tuple(tensor.shape))}"
        )
    return tensor.contiguous()

"""The disk path: a validated checkpoint's tensors, with the recipe's processing applied.

``zero_copy`` (the default) maps each shard file as ``safetensors.torch.load_file`` does:
private and copy-on-write (``torch.UntypedStorage.from_file(..., shared=False)``, which
maps ``MAP_PRIVATE``; mmap(2)). Every tensor the recipe leaves as stored, at an offset
aligned to its dtype, is a view of that mapping, built by the attach's view builder
(:func:`weightcache._handles.build_views`); nothing of it is read until it is used. The
other tensors (a cast, a tensor-parallel slice, a plugin's output, a misaligned tensor)
are computed from the shard files into private memory, as the daemon computes them.
``copy`` reads every tensor into private memory.

Either way every shard's identity (dev, inode, size, mtime, ctime) is checked after the
tensors are made (:meth:`Checkpoint.check_unchanged`): a shard changed or truncated since
it was validated is an :class:`InvalidCheckpointError`, never a tensor of other bytes.
What a mapping cannot promise, as ``load_file``'s cannot: its pages not yet written stay
the file's, so a shard rewritten in place *after* the load changes them, and one truncated
after it makes a read past its new end fail with ``SIGBUS``. Checkpoints are replaced by
writing a new file and renaming it (as ``huggingface_hub`` and ``safetensors`` writers
do), which leaves a mapping of the old one intact; ``copy`` is immune either way.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import cast

import torch

from weightcache._handles import build_views
from weightcache.core.checkpoint import Checkpoint, ShardInfo, TensorInfo, open_checkpoint
from weightcache.core.dtypes import itemsize
from weightcache.core.errors import InvalidCheckpointError
from weightcache.core.fingerprint import Fingerprint, Level, compute_fingerprint
from weightcache.core.pipeline import CheckpointReader, Node, materialize
from weightcache.core.recipe import Placement, Recipe
from weightcache.core.records import ViewColumns


def read_tensors(
    checkpoint: Checkpoint, nodes: dict[str, Node], *, copy: bool
) -> dict[str, torch.Tensor]:
    """Every node's tensor, in ``nodes``' order, then the shards' identity checked.

    Args:
        checkpoint: the validated checkpoint, its files open.
        nodes: the recipe's output tensors (``Pipeline.nodes``).
        copy: read every tensor into private memory instead of mapping the shards.

    Returns:
        Name -> CPU tensor: views of the shard mappings where possible (module
        docstring), new contiguous tensors otherwise.

    Raises:
        InvalidCheckpointError: a shard changed (dev, inode, size, mtime or ctime) since
            it was opened, or ended early while read; the tensors are not returned.
        RuntimeError: a recipe stage produced another dtype or shape than it planned.
    """
    views = {} if copy else _mapped_views(checkpoint, nodes)
    tensors = {}
    with CheckpointReader(checkpoint) as reader:
        for name, node in nodes.items():
            view = views.get(name)
            tensors[name] = view if view is not None else materialize(node, reader)
    # The fingerprint was computed from these files before they were mapped or read here.
    checkpoint.check_unchanged()
    return tensors


def fingerprint_later(
    path: str | os.PathLike[str],
    checkpoint: Checkpoint,
    recipe: Recipe,
    placement: Placement,
    level: Level,
) -> Callable[[], Fingerprint]:
    """The fingerprint of a checkpoint loaded from disk, to compute when first asked.

    A load from disk needs no fingerprint (no daemon is asked), yet computing it at the
    default level ``full`` costs a hash-cache lookup per shard, or a read of every byte
    where the cache has no digest: more than ``safetensors.torch.load_file`` takes for a
    small checkpoint. So ``LoadedWeights.fingerprint`` calls this instead: it opens
    ``path`` again and fingerprints it when its files are the very files loaded (the
    identities of ``checkpoint``: dev, inode, size, mtime, ctime of every shard and of
    the index), as :func:`compute_fingerprint` would have at the load.

    Args:
        path: what was opened (a folder or a ``.safetensors`` file; a Hub snapshot).
        checkpoint: the checkpoint as loaded (its files may be closed).
        recipe, placement, level: the load's.

    Returns:
        A callable that returns the fingerprint, and raises
        :class:`InvalidCheckpointError` when a file changed (or was replaced) since the
        load, or the checkpoint is no longer valid: no fingerprint then describes the
        bytes that were loaded.
    """
    loaded = checkpoint.file_identities()

    def compute() -> Fingerprint:
        with open_checkpoint(path) as again:
            if again.file_identities() != loaded:
                raise InvalidCheckpointError(
                    f"{checkpoint.root}: a file changed since these weights were loaded "
                    "from it; no fingerprint describes the bytes loaded"
                )
            fingerprint = compute_fingerprint(again, recipe, placement, level)
            again.check_unchanged()
            return fingerprint

    return compute


def _mapped_views(checkpoint: Checkpoint, nodes: dict[str, Node]) -> dict[str, torch.Tensor]:
    """Views of the shard mappings for the nodes that are a stored tensor, aligned; each
    stored tensor once (a second name for it gets its own copy, as from ``copy``)."""
    by_shard: dict[str, list[tuple[str, TensorInfo]]] = {}
    seen: set[str] = set()
    for name, node in nodes.items():
        info = node.stored
        # A view's address must be a multiple of its element size (torch's typed views,
        # and the CPU's loads); the mapping starts on a page.
        if info is None or info.name in seen or info.begin % itemsize(info.dtype):
            continue
        seen.add(info.name)
        by_shard.setdefault(info.shard, []).append((name, info))
    views: dict[str, torch.Tensor] = {}
    for shard in checkpoint.shards:
        rows = by_shard.get(shard.name)
        base = _map(checkpoint, shard) if rows else None
        if rows and base is not None:
            views.update(build_views(base, _columns(rows)))
    return views


def _map(checkpoint: Checkpoint, shard: ShardInfo) -> torch.Tensor | None:
    """The shard's ``shard.size`` bytes mapped private, as a 1-D ``uint8`` tensor; None
    when it cannot be mapped (its tensors are then read).

    The file opened and validated is mapped through ``/proc/self/fd``, never its path
    again (a file renamed in its place since is not the one mapped), and torch closes
    its own descriptor once mapped: tensors hold no descriptor.

    Raises:
        InvalidCheckpointError: the file is shorter than it was when validated.
    """
    path = f"/proc/self/fd/{checkpoint.fd(shard.name)}"
    try:
        mapped = torch.UntypedStorage.from_file(path, shared=False, nbytes=shard.size)
    except RuntimeError:  # shorter than validated (then raised here), or no /proc
        checkpoint.check_unchanged()
        return None
    # torch's stubs type from_file's result as the storage base class.
    return torch.empty(0, dtype=torch.uint8).set_(cast(torch.UntypedStorage, mapped))


def _columns(rows: list[tuple[str, TensorInfo]]) -> ViewColumns:
    """The rows as the view builder's columns: contiguous strides, byte offsets from the
    file's start, and each byte length for the builder to check against the shape."""
    shape: list[int] = []
    stride: list[int] = []
    for _, info in rows:
        shape.extend(info.shape)
        stride.extend(_contiguous(info.shape))
    return ViewColumns(
        names=[name for name, _ in rows],
        dtypes=[info.dtype for _, info in rows],
        ranks=[len(info.shape) for _, info in rows],
        shape=shape,
        stride=stride,
        byte_offsets=[info.begin for _, info in rows],
        nbytes=[info.nbytes for _, info in rows],
    )


def _contiguous(shape: tuple[int, ...]) -> list[int]:
    """Row-major strides, in elements, as torch makes them (a size 0 counts as 1)."""
    strides = [1] * len(shape)
    for i in range(len(shape) - 1, 0, -1):
        strides[i - 1] = strides[i] * max(shape[i], 1)
    return strides

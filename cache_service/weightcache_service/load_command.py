"""``weightcache load PATH|REPO_ID``: ask a running daemon to preload a checkpoint (the
Preload RPC) and follow its progress with a progress bar (``rich``, on stderr) until the
model is READY.

The daemon reads the files itself: it must have been started with
``--allow-remote-preload`` and a ``--model-root`` that holds the checkpoint (for a Hub
repo id, the Hub cache folder). The path sent is the realpath of the local one, so the
daemon and this command must see the same file system.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Sequence

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TransferSpeedColumn,
)

from weightcache.core import hub
from weightcache.core.errors import InvalidCheckpointError
from weightcache.core.rpc import call, connect
from weightcache.v1 import weight_cache_service_pb2 as pb


def preload_request(
    model: str,
    revision: str | None,
    dtype: str | None,
    seed_from: str = "",
    plugins: Sequence[pb.RecipePlugin] = (),
) -> pb.PreloadRequest:
    """The Preload request for a path, or a Hub repo id: then ``repo_id`` and
    ``revision``, which the daemon resolves in its own Hub cache and names the model
    after; with ``path`` too, the snapshot this command finds in the local Hub cache, for
    a daemon older than those fields (a repo id not found there is sent alone: the
    daemon's cache may hold it).
    Seeded from the peer daemon ``seed_from`` (``HOST:PORT``) when given; ``plugins``: the
    recipe's plugin steps, in order (the daemon applies only those its ``--allow-recipe``
    names).

    Raises:
        InvalidCheckpointError: ``model`` is neither a path nor of the form of a repo id
            (``org/name``).
    """
    recipe = pb.Recipe(dtype=dtype or "", plugins=plugins)
    try:
        found = hub.find(model, revision)
    except InvalidCheckpointError:
        repo_id, named = hub.split_revision(model)
        if os.path.isabs(model) or repo_id.count("/") != 1:
            raise
        # Not in this command's Hub cache: the daemon's may hold it (its answer says).
        return pb.PreloadRequest(
            repo_id=repo_id,
            revision=revision or named or "",
            recipe=recipe,
            seed_from=seed_from,
        )
    if found is None:
        return pb.PreloadRequest(path=os.path.realpath(model), recipe=recipe, seed_from=seed_from)
    return pb.PreloadRequest(
        path=os.path.realpath(found.path),
        repo_id=found.repo_id,
        revision=found.revision or "",
        recipe=recipe,
        seed_from=seed_from,
    )


def follow(replies: Iterable[pb.PreloadResponse], console: Console) -> pb.PreloadResponse:
    """Show each progress message on a bar (bytes written of bytes to write); returns the
    last message (state READY when the load succeeded)."""
    last = pb.PreloadResponse()
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        # Decimal units in both, as TransferSpeedColumn has no binary ones: GB and MB/s.
        DownloadColumn(binary_units=False),
        TransferSpeedColumn(),
        TimeElapsedColumn(),
    )
    replies = iter(replies)
    first = next(replies, None)  # a refusal comes before any bar is drawn
    if first is None:
        return last
    with Progress(*columns, console=console) as bar:
        task = bar.add_task(first.model, total=None)
        for reply in itertools.chain([first], replies):
            last = reply
            done, total = reply.progress.bytes_done, reply.progress.bytes_total
            bar.update(task, completed=done, total=total or None)
    return last


def run_load(
    socket: str,
    model: str,
    revision: str | None,
    *,
    dtype: str | None,
    timeout: float | None,
    console: Console,
    seed_from: str = "",
    plugins: Sequence[pb.RecipePlugin] = (),
) -> pb.PreloadResponse:
    """Preload ``model`` on the daemon at ``socket`` and follow it to the end (seeded from
    the peer daemon ``seed_from`` first, when given: docs/seeding.md).

    Returns:
        The last progress message (READY).

    Raises:
        InvalidCheckpointError: ``model`` is neither a path nor a cached Hub repo, or the
            daemon found it malformed.
        WeightCacheError: the daemon refused or the load failed (its reason:
            ``PERMISSION_DENIED`` without ``--allow-remote-preload``/``--model-root``,
            ``MODEL_EXISTS``, ``RESOURCE_EXHAUSTED``, ``MODEL_FAILED``...).
        DaemonUnavailableError: no daemon answered, or ``timeout`` seconds passed.
    """
    request = preload_request(model, revision, dtype, seed_from, plugins)
    channel, stub = connect(socket)
    with channel:
        return call(lambda: follow(stub.Preload(request, timeout=timeout), console))

"""Changing a checkpoint's files while a daemon loads it, at a known point.

A remote Preload with the ``pause`` recipe plugin (``tests/plugins``) holds the daemon's
load thread after the checkpoint was opened, validated and fingerprinted, before any
tensor is read. :func:`preload_changing` runs such a Preload, changes the files in that
window, lets the load go on, and returns how the Preload ended.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc

from tests.recipe_support import RecipeWorker, RecipeWorkerPool, children_env, environ, preload
from tests.support import Daemon, DaemonPool, RpcFailure, rpc_failure
from weightcache.v1 import weight_cache_service_pb2 as pb

REACHED_TIMEOUT = 60.0


@dataclass(frozen=True)
class Racing:
    """A daemon that preloads remotely from ``root`` with the ``pause`` plugin allowed.

    Attributes:
        root: its ``--model-root`` (empty at start).
        daemon: the daemon.
        worker: a recipe worker (the plugins importable, as in the daemon).
        base: a scratch folder outside the root.
    """

    root: Path
    daemon: Daemon
    worker: RecipeWorker
    base: Path


@contextlib.contextmanager
def racing_daemon(daemons: DaemonPool, tmp_path: Path) -> Iterator[Racing]:
    """Start a :class:`Racing` daemon and its worker; the worker ends with the block."""
    root = tmp_path / "root"
    root.mkdir()
    env = children_env(tmp_path / "hash-cache")
    args = ["--allow-remote-preload", "--model-root", str(root), "--allow-recipe", "pause"]
    with environ(env):
        daemon = daemons.start(args=args)
    workers = RecipeWorkerPool(tmp_path, env)
    try:
        yield Racing(root, daemon, workers.start(), tmp_path)
    finally:
        workers.close()


def pause_step(pause: Path) -> str:
    """The ``pause`` plugin step as ``PluginStep.parse`` (and the worker) takes it."""
    return f"pause:dir={pause}"


def preload_changing(
    socket: str,
    path: Path,
    pause: Path,
    change: Callable[[], None],
    level: int = pb.FINGERPRINT_LEVEL_UNSPECIFIED,
) -> list[pb.PreloadResponse] | RpcFailure:
    """Remote Preload of ``path`` with ``pause:dir=PAUSE``; ``change()`` runs while the load
    is held, before it reads any tensor. Returns the responses, or the failure.

    Raises:
        AssertionError: the load never reached the pause, or the Preload did not end.
    """
    pause.mkdir()
    outcome: list[list[pb.PreloadResponse] | RpcFailure] = []

    def run() -> None:
        try:
            outcome.append(
                preload(socket, path, plugins=[("pause", {"dir": str(pause)})], level=level)
            )
        except grpc.RpcError as exc:
            outcome.append(rpc_failure(exc))

    thread = threading.Thread(target=run)
    thread.start()
    try:
        wait_reached(pause, thread.is_alive)
        change()
    finally:
        (pause / "go").touch()
        thread.join(REACHED_TIMEOUT)
    assert not thread.is_alive(), "the Preload did not end"
    return outcome[0]


def wait_reached(pause: Path, running: Callable[[], bool]) -> None:
    """Wait until a load holds at the ``pause`` plugin.

    Raises:
        AssertionError: ``running()`` turned false first, or it took too long.
    """
    deadline = time.monotonic() + REACHED_TIMEOUT
    while not (pause / "reached").exists():
        assert running(), "the load ended before the pause"
        assert time.monotonic() < deadline, "the load never reached the pause"
        time.sleep(0.01)


def rewrite_data_in_place(shard: Path) -> None:
    """Same inode, same size, same header; every data byte different."""
    raw = bytearray(shard.read_bytes())
    data_start = 8 + int.from_bytes(raw[:8], "little")
    with open(shard, "r+b") as fh:
        fh.seek(data_start)
        fh.write(bytes(b ^ 0xFF for b in raw[data_start:]))

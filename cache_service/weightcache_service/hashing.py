"""Hashing a checkpoint's shards while a load copies them (fingerprint level ``full``).

A first load at level ``full`` must read every byte twice over: once to hash it, once to
copy it into the arena. Done one after the other, a cold checkpoint is read from disk
twice (when it does not fit the page cache) and the load takes the sum of both times.
:class:`ShardHashes` runs the hashes in threads beside the copy, through the checkpoint's
own open descriptors (the ones the copy reads), so the disk is read about once and the
load takes about the longer of the two. hashlib and ``pread`` release the GIL on large
buffers, so the threads run on other cores while the copy runs in the kernel
(``sendfile``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait

from weightcache.core.checkpoint import Checkpoint
from weightcache.core.errors import InvalidCheckpointError, ModelFailedError
from weightcache.core.hashcache import fd_sha256

__all__ = ["POLL", "ShardHashes"]

#: Seconds between checks of a load's cancellation while it waits for its hashes.
POLL = 0.1


class ShardHashes:
    """The sha256 of every shard of ``checkpoint``, computed in background threads (one a
    shard, at most one a core) from the moment it is made; shards the hash cache holds for
    their identity are not read.

    Args:
        checkpoint: an open checkpoint; it must stay open until :meth:`stop` returns.
    """

    def __init__(self, checkpoint: Checkpoint) -> None:
        self._stop = threading.Event()
        workers = max(1, min(len(checkpoint.shards), os.cpu_count() or 1))
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="weightcache-hash")
        self._futures: dict[str, Future[str]] = {}
        try:
            for shard in checkpoint.shards:
                fd = checkpoint.fd(shard.name)
                future = self._pool.submit(fd_sha256, fd, shard.path, stop=self._stop)
                self._futures[shard.name] = future
        except BaseException:
            self.stop()  # a thread that could not start: none may outlive the descriptors
            raise

    def result(self, cancelled: Callable[[], bool] = lambda: False) -> dict[str, str]:
        """Shard name -> lowercase hex sha256 of all its bytes, waiting for the threads.

        Args:
            cancelled: polled every :data:`POLL` seconds while waiting.

        Raises:
            InvalidCheckpointError: a shard could not be read (the error is named).
            ModelFailedError: ``cancelled()`` turned true first (the daemon is stopping).
        """
        while wait(self._futures.values(), timeout=POLL).not_done:
            if cancelled():
                raise ModelFailedError("load cancelled at shutdown while hashing its shards")
        digests = {}
        for name, future in self._futures.items():
            try:
                digests[name] = future.result()
            except OSError as exc:
                raise InvalidCheckpointError(f"{name}: cannot be read to hash it: {exc}") from exc
        return digests

    def stop(self) -> None:
        """Stop the hashes still running and wait for their threads to end (within one
        :data:`~weightcache.core.hashcache.CHUNK` read each), so that the caller may close
        the descriptors. Idempotent."""
        self._stop.set()
        self._pool.shutdown(wait=True, cancel_futures=True)

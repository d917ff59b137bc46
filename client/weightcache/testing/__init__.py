"""weightcache.testing: a test harness for code that uses weightcache, real processes only.

Shipped with the package, like ``structlog.testing``: start a real daemon on a Unix
socket in a temporary folder, write small deterministic checkpoints, and attach from a
worker in a separate Python process; then check bitwise what it got and that the daemon
left nothing in ``/dev/shm``. Nothing is mocked::

    from weightcache.testing import make_checkpoints, run_daemon, worker_pool

    def test_attach(tmp_path):
        ckpt = make_checkpoints(tmp_path / "ckpt")
        with run_daemon([ckpt.single]) as daemon, worker_pool(tmp_path) as workers:
            reply = workers.start().load(ckpt.single, socket=daemon.socket,
                                         dump=tmp_path / "got.safetensors")
            assert reply["source"] == "cache", reply["fallback_reason"]
            assert_bitwise_equal(load_file(tmp_path / "got.safetensors"), ckpt.tensors)

Modules (one concept each):

- ``daemon``: :func:`run_daemon`, :class:`Daemon`, :class:`DaemonPool`, the one
  :data:`READY_TIMEOUT`, the readiness check (:func:`health`) and leftover checks;
- ``checkpoints``: :func:`make_checkpoints`, :func:`reference_tensors`, writers for
  single-file and sharded checkpoints, :func:`assert_bitwise_equal`;
- ``driver``: :class:`Worker`, :class:`WorkerPool`, :func:`worker_pool` (the test's end);
- ``worker``: the worker process, ``python -m weightcache.testing.worker``;
- ``protocol``: the JSON line protocol both ends speak, for workers of one's own;
- ``logs``: :func:`capture_sdk_logs`, what the SDK logs (standard ``logging``) as dicts;
- ``pytest_plugin``: fixtures ``wc_checkpoints``, ``wc_daemons``, ``wc_workers``; opt in
  with ``pytest_plugins = ["weightcache.testing.pytest_plugin"]`` in a ``conftest.py``.

Importing this package does not import pytest, nor the daemon's code.
"""

from weightcache.core.sockets import segment_tag
from weightcache.testing.checkpoints import (
    INDEX_FILE,
    METADATA,
    SHARD_1,
    SHARD_2,
    SHARD_OF,
    SINGLE_FILE,
    SMALL_TENSOR,
    Checkpoints,
    assert_bitwise_equal,
    make_checkpoints,
    raw_bytes,
    reference_tensors,
    wait_until_settled,
    write_sharded,
    write_single,
)
from weightcache.testing.daemon import (
    READY_TIMEOUT,
    STOP_TIMEOUT,
    Daemon,
    DaemonPool,
    DaemonStartError,
    DaemonStopError,
    HarnessError,
    child_env,
    daemon_pool,
    health,
    list_models,
    run_daemon,
    shm_segments,
    short_tempdir,
    wait_or_kill,
)
from weightcache.testing.driver import (
    WORKER_COMMAND,
    WORKER_TIMEOUT,
    Worker,
    WorkerDiedError,
    WorkerPool,
    WorkerTimeoutError,
    worker_pool,
)
from weightcache.testing.logs import capture_sdk_logs

__all__ = [
    "INDEX_FILE",
    "METADATA",
    "READY_TIMEOUT",
    "SHARD_1",
    "SHARD_2",
    "SHARD_OF",
    "SINGLE_FILE",
    "SMALL_TENSOR",
    "STOP_TIMEOUT",
    "WORKER_COMMAND",
    "WORKER_TIMEOUT",
    "Checkpoints",
    "Daemon",
    "DaemonPool",
    "DaemonStartError",
    "DaemonStopError",
    "HarnessError",
    "Worker",
    "WorkerDiedError",
    "WorkerPool",
    "WorkerTimeoutError",
    "assert_bitwise_equal",
    "capture_sdk_logs",
    "child_env",
    "daemon_pool",
    "health",
    "list_models",
    "make_checkpoints",
    "raw_bytes",
    "reference_tensors",
    "run_daemon",
    "segment_tag",
    "shm_segments",
    "short_tempdir",
    "wait_or_kill",
    "wait_until_settled",
    "worker_pool",
    "write_sharded",
    "write_single",
]

"""pytest fixtures of the harness; not registered globally. Opt in from a ``conftest.py``::

    pytest_plugins = ["weightcache.testing.pytest_plugin"]

Fixtures:

- ``wc_checkpoints`` (session): :class:`~weightcache.testing.Checkpoints` in a temporary
  folder;
- ``wc_daemons``: a :class:`~weightcache.testing.DaemonPool` for one test; at teardown its
  daemons are stopped and it fails the test if one left a socket, a lock file or a
  segment (after a SIGKILL, a fresh daemon on the same socket must remove the dead one's);
- ``wc_module_daemons``: the same, shared by one module's tests;
- ``wc_workers``: a :class:`~weightcache.testing.WorkerPool`; its workers end after the
  test, before its daemons stop (their leases are released first);
- ``wc_hash_cache`` (session, used by every test): ``$WEIGHTCACHE_HASH_CACHE`` set to a
  temporary folder for the session, so that the daemons and workers it starts (they
  inherit the environment) remember file digests there, not in the user's ``~/.cache``
  (the default fingerprint level, ``full``, hashes every checkpoint loaded).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from weightcache.testing.checkpoints import Checkpoints, make_checkpoints
from weightcache.testing.daemon import DaemonPool, daemon_pool
from weightcache.testing.driver import WorkerPool, worker_pool


@pytest.fixture(scope="session", autouse=True)
def wc_hash_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The session's folder of remembered file digests (``$WEIGHTCACHE_HASH_CACHE``)."""
    folder = tmp_path_factory.mktemp("hash-cache")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WEIGHTCACHE_HASH_CACHE", str(folder))
        yield folder


@pytest.fixture(scope="session")
def wc_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    """The small deterministic checkpoints, written once per session (read-only)."""
    return make_checkpoints(tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture
def wc_daemons(tmp_path: Path) -> Iterator[DaemonPool]:
    """Start daemons for one test; all stopped and checked for leftovers after it."""
    with daemon_pool(tmp_path) as pool:
        yield pool


@pytest.fixture(scope="module")
def wc_module_daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonPool]:
    """Like ``wc_daemons``, for read-mostly daemons shared by one module's tests."""
    with daemon_pool(tmp_path_factory.mktemp("daemon-logs")) as pool:
        yield pool


@pytest.fixture
def wc_workers(wc_daemons: DaemonPool, tmp_path: Path) -> Iterator[WorkerPool]:
    """Start worker processes; ended after the test, before its daemons stop."""
    with worker_pool(tmp_path) as pool:
        yield pool

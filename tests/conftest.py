"""Fixtures: checkpoints on disk, real daemons on real sockets, real worker processes.

The harness's own fixtures (``weightcache.testing.pytest_plugin``) under the names the
tests use. Every daemon fixture checks at teardown that its daemons left no socket, lock
file or /dev/shm segment behind (after a SIGKILL, a fresh daemon on the same socket must
remove the dead one's segments).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fault_support import Children, Zygote, zygote_for
from weightcache.testing import Checkpoints, DaemonPool, WorkerPool

pytest_plugins = ["weightcache.testing.pytest_plugin"]


@pytest.fixture(scope="session")
def checkpoints(wc_checkpoints: Checkpoints) -> Checkpoints:
    return wc_checkpoints


@pytest.fixture
def daemons(wc_daemons: DaemonPool) -> DaemonPool:
    """Start daemons for one test; all stopped and checked for leftovers after it."""
    return wc_daemons


@pytest.fixture(scope="module")
def module_daemons(wc_module_daemons: DaemonPool) -> DaemonPool:
    """Like :func:`daemons`, for read-mostly daemons shared by one module's tests."""
    return wc_module_daemons


@pytest.fixture
def workers(wc_workers: WorkerPool) -> WorkerPool:
    """Start worker processes; ended after the test, before its daemons stop."""
    return wc_workers


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Zygote]:
    with zygote_for(tmp_path_factory.mktemp("zygote")) as forker:
        yield forker


@pytest.fixture
def children(daemons: DaemonPool, zygote: Zygote, tmp_path: Path) -> Iterator[Children]:
    """Forked workers of one test; ended (leases released) before its daemons stop."""
    pool = Children(zygote, daemons.sock_dir, tmp_path)
    yield pool
    pool.close()

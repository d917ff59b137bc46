"""Fixtures: checkpoints on disk, real daemons on real sockets, real worker processes.

Every daemon fixture checks at teardown that its daemons left no socket, lock file or
/dev/shm segment behind (after a SIGKILL, a fresh daemon on the same socket must remove
the dead one's segments).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fault_support import Children, Zygote, zygote_for
from tests.support import Checkpoints, DaemonPool, WorkerPool, make_checkpoints, short_tempdir


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    return make_checkpoints(tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[DaemonPool]:
    """Start daemons for one test; all stopped and checked for leftovers after it."""
    pool = DaemonPool(short_tempdir(), tmp_path)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def module_daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonPool]:
    """Like :func:`daemons`, for read-mostly daemons shared by one module's tests."""
    pool = DaemonPool(short_tempdir(), tmp_path_factory.mktemp("daemon-logs"))
    yield pool
    pool.close()


@pytest.fixture
def workers(daemons: DaemonPool, tmp_path: Path) -> Iterator[WorkerPool]:
    """Start worker processes; ended after the test, before its daemons stop."""
    pool = WorkerPool(tmp_path)
    yield pool
    pool.close()


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

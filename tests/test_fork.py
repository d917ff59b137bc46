"""Workers forked while other threads of the parent are inside SDK calls (issue 27, item
3): every child loads from the cache, bitwise, or from disk with a documented reason;
none hangs or crashes. Real forks (``os.fork``) of a real process, against a real daemon.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import Checkpoints, Daemon, DaemonPool
from weightcache.testing import child_env

pytestmark = pytest.mark.timeout(300)

SCRIPT = Path(__file__).resolve().parent / "fork_churn.py"


@pytest.fixture(scope="module")
def daemon(module_daemons: DaemonPool, checkpoints: Checkpoints) -> Iterator[Daemon]:
    yield module_daemons.start([checkpoints.single])


def churn(
    daemon: Daemon, path: Path, children: int, threads: int, env: dict[str, str] | None = None
) -> dict[str, object]:
    run = subprocess.run(
        [sys.executable, str(SCRIPT), str(path), daemon.socket, str(children), str(threads)],
        check=False,
        capture_output=True,
        text=True,
        env=child_env(env),
        timeout=240,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    result: dict[str, object] = json.loads(run.stdout.splitlines()[-1])
    return result


def test_children_forked_during_sdk_calls_all_load_from_the_cache(
    daemon: Daemon, checkpoints: Checkpoints
) -> None:
    # Before: of 60 such children, 1 SIGSEGV in gRPC's poller and 2 fallbacks ("Wrong
    # file descriptor generation"); a run of 20 does not always show it.
    result = churn(daemon, checkpoints.single, children=20, threads=4)
    assert result["outcomes"] == {"cache": 20}, result


def test_without_grpc_fork_support_a_forked_child_falls_back_with_its_reason(
    daemon: Daemon, checkpoints: Checkpoints
) -> None:
    # The operator turned gRPC's fork support off: the child must not touch the gRPC state
    # it inherited, and says why (before: it used it, and could hang or crash).
    result = churn(
        daemon, checkpoints.single, children=3, threads=0, env={"GRPC_ENABLE_FORK_SUPPORT": "0"}
    )
    assert result["outcomes"] == {"DAEMON_UNAVAILABLE": 3}, result
    details = result["details"]
    assert isinstance(details, list)
    assert all("gRPC's fork support is off" in d for d in details), details

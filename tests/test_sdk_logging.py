"""The SDK logs through standard ``logging`` (logger ``weightcache``): a host
application's handlers and levels apply, and nothing goes to stdout."""

from __future__ import annotations

import logging

import pytest

import weightcache
from tests.support import Checkpoints, DaemonPool


def test_fallback_warning_reaches_the_hosts_handlers(
    daemons: DaemonPool,
    checkpoints: Checkpoints,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    absent = daemons.socket("absent")
    caplog.set_level(logging.INFO, logger="weightcache")

    weights = weightcache.load(checkpoints.single, socket=absent)

    assert weights.source == "disk"
    [record] = [r for r in caplog.records if r.name == "weightcache"]
    assert (record.levelno, record.wc_event) == (logging.WARNING, "loading from disk")  # type: ignore[attr-defined]
    assert record.wc_fields == {  # type: ignore[attr-defined]
        "reason": "DAEMON_UNAVAILABLE",
        "detail": weights.fallback_reason.detail if weights.fallback_reason else None,
        "path": str(checkpoints.single.resolve()),
    }
    assert record.getMessage().startswith("loading from disk reason='DAEMON_UNAVAILABLE' ")
    assert capsys.readouterr().out == ""


def test_host_level_silences_the_sdk(
    daemons: DaemonPool, checkpoints: Checkpoints, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="weightcache")

    weights = weightcache.load(checkpoints.single, socket=daemons.socket("absent"))

    assert weights.source == "disk"
    assert [r for r in caplog.records if r.name == "weightcache"] == []

"""``--log-format json``: the daemon's log holds JSON lines only, standard ``logging``'s
records (libraries', the SDK's) included, rendered by the same processors as structlog's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support import Checkpoints
from weightcache.testing.daemon import DaemonPool


def test_a_json_log_holds_json_lines_only(
    daemons: DaemonPool, checkpoints: Checkpoints, tmp_path: Path
) -> None:
    missing = tmp_path / "nowhere"  # refused at start-up: a warning line
    daemon = daemons.start([checkpoints.single, missing], args=["--log-format", "json"])
    assert daemon.stop() == 0

    lines = [json.loads(line) for line in daemon.log().splitlines() if line.strip()]

    assert lines, "the daemon logged nothing"
    assert all({"event", "level", "timestamp"} <= set(line) for line in lines)
    events = [line["event"] for line in lines]
    assert "listening" in events


def test_standard_logging_records_are_rendered_as_json_too() -> None:
    # A library's record (standard logging) and a daemon event (structlog), in a process of
    # their own: configure_logging replaces the root logger's handlers.
    script = (
        "import logging, structlog\n"
        "from weightcache_service.cli import configure_logging\n"
        "configure_logging('json', 'info')\n"
        "logging.getLogger('somelib').warning('disk %s is slow', 'sda')\n"
        "logging.getLogger('somelib').debug('not shown')\n"
        "structlog.get_logger('weightcache.daemon').info('listening', socket='s')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )

    lines = [json.loads(line) for line in done.stderr.splitlines()]
    assert [(x["event"], x["level"], x.get("logger")) for x in lines] == [
        ("disk sda is slow", "warning", "somelib"),
        ("listening", "info", None),
    ]
    assert lines[1]["socket"] == "s"

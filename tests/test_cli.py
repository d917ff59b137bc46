"""The ``weightcache`` command against a real daemon."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import (
    Checkpoints,
    Daemon,
    DaemonPool,
    WorkerPool,
    assert_attached,
    child_env,
    cli_command,
    get_model,
    health,
    run_cli,
)


@pytest.fixture(scope="module")
def daemon(module_daemons: DaemonPool, checkpoints: Checkpoints) -> Daemon:
    return module_daemons.start([checkpoints.single])


def _ls_rows(socket: str) -> list[dict[str, str]]:
    result = run_cli("ls", "--socket", socket)
    assert (result.returncode, result.stderr) == (0, "")
    header, *rows = (line.split() for line in result.stdout.splitlines())
    assert header == ["NAME", "STATE", "BYTES", "TENSORS", "LEASES", "DTYPE", "FINGERPRINT"]
    return [dict(zip(header, row, strict=True)) for row in rows]


def test_health_serving(daemon: Daemon) -> None:
    result = run_cli("health", "--socket", daemon.socket)

    assert (result.returncode, result.stdout) == (0, "SERVING\n")


def test_health_without_daemon_fails(module_daemons: DaemonPool) -> None:
    socket = module_daemons.socket("absent")
    result = run_cli("health", "--socket", socket, "--timeout", "2")

    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr == f"weightcache health: no daemon socket at {socket}\n"


def test_ls_lists_model_state_and_leases(
    daemon: Daemon, workers: WorkerPool, checkpoints: Checkpoints
) -> None:
    model = get_model(daemon.socket, "single")
    worker = workers.start()
    reply = worker.load(checkpoints.single, socket=daemon.socket, ttl=1.5)
    assert_attached(reply)

    [row] = _ls_rows(daemon.socket)

    assert row == {
        "NAME": "single",
        "STATE": "READY",
        "BYTES": str(model.size_bytes),
        "TENSORS": "9",
        "LEASES": "1",
        "DTYPE": "-",
        "FINGERPRINT": model.fingerprint.digest[:16],
    }
    assert worker.request("close", key="w")["ok"]
    [row] = _ls_rows(daemon.socket)
    assert row["LEASES"] == "0"


def test_second_daemon_on_a_socket_names_the_first(daemon: Daemon) -> None:
    second = subprocess.run(
        [sys.executable, "-m", "weightcache_service.cli", "preload", "--socket", daemon.socket],
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env(),
        check=False,
    )

    assert second.returncode != 0
    assert f"pid {daemon.pid}" in second.stderr
    assert daemon.proc.poll() is None
    assert health(daemon.socket) == "SERVING"


# -- the shipped systemd units (issue 9, item 3) --------------------------------------

UNITS = sorted((Path(__file__).resolve().parent.parent / "deploy" / "systemd").glob("*.service"))


def _service_section(unit: Path) -> dict[str, list[str]]:
    """``[Service]`` of a unit file: each key with all its values, in order (a key may
    repeat; systemd.syntax(7))."""
    section: dict[str, list[str]] = {}
    current = None
    for raw in unit.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = line
        elif current == "[Service]":
            key, _, value = line.partition("=")
            section.setdefault(key, []).append(value)
    return section


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_systemd_units_run_as_a_dedicated_user_with_hardening(unit: Path) -> None:
    service = _service_section(unit)

    assert (service["User"], service["Group"]) == (["weightcache"], ["weightcache"])
    assert "DynamicUser" not in service  # segments need a stable owner
    assert "--group weightcache" in service["ExecStart"][0]
    assert service["CapabilityBoundingSet"] == [""]
    assert service["RestrictAddressFamilies"] == ["AF_UNIX AF_INET AF_INET6"]
    assert service["ReadWritePaths"] == ["/dev/shm"]
    assert service["RuntimeDirectoryMode"] == ["0750"]
    for key, value in {
        "ProtectSystem": "strict",
        "NoNewPrivileges": "yes",
        "PrivateTmp": "yes",
        "ProtectHome": "read-only",
        "SystemCallArchitectures": "native",
        "LockPersonality": "yes",
        "RestrictSUIDSGID": "yes",
    }.items():
        assert service[key] == [value], key
    assert [p.name for p in UNITS] == ["weightcache.service", "weightcache@.service"]


def _gc_lines(result: subprocess.CompletedProcess[str], paths: list[str]) -> list[str]:
    """The lines of ``weightcache gc`` output about ``paths`` (other dead daemons' segments
    of this machine may be listed too)."""
    return [line for line in result.stdout.splitlines() if any(p in line for p in paths)]


def test_gc_removes_a_dead_daemons_segments_and_keeps_a_live_ones(
    daemons: DaemonPool, checkpoints: Checkpoints
) -> None:
    dead = daemons.start([checkpoints.single])
    live = daemons.start([checkpoints.other])
    [gone] = dead.segments()
    [kept] = live.segments()
    size = os.stat(gone).st_size
    dead.kill()

    dry = run_cli("gc", "--dry-run")
    assert (dry.returncode, dry.stderr) == (0, "")
    assert _gc_lines(dry, [gone, kept]) == [
        f"would remove {gone} ({size} bytes, daemon pid {dead.pid})"
    ]
    assert dead.segments() == [gone]

    result = run_cli("gc")

    assert (result.returncode, result.stderr) == (0, "")
    assert _gc_lines(result, [gone, kept]) == [
        f"removed {gone} ({size} bytes, daemon pid {dead.pid})"
    ]
    assert dead.segments() == []
    assert live.segments() == [kept]
    assert health(live.socket) == "SERVING"
    again = run_cli("gc")
    assert (again.returncode, _gc_lines(again, [gone, kept])) == (0, [])


def test_ls_shows_a_failed_models_error(daemons: DaemonPool, checkpoints: Checkpoints) -> None:
    headroom = 2**50  # no machine has it: the start-up preload is refused
    daemon = daemons.start([checkpoints.single], args=["--headroom", str(headroom)])

    result = run_cli("ls", "--socket", daemon.socket)

    assert (result.returncode, result.stderr) == (0, "")
    header, row, error = result.stdout.splitlines()
    assert header.split()[:2] == ["NAME", "STATE"]
    assert row.split()[:2] == ["single", "FAILED"]
    assert error.startswith(f"single: single needs {get_model(daemon.socket, 'single').size_bytes}")
    assert f"plus {headroom} of headroom" in error


NOBODY = 65534


def test_gc_removes_only_the_callers_own_dead_segments(
    daemons: DaemonPool, checkpoints: Checkpoints
) -> None:
    """Run as another uid (``setpriv``, so root is needed), gc leaves root's dead segments
    alone and removes the one that uid owns."""
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        pytest.skip("needs root and setpriv(1) to run gc as another user")
    dead = daemons.start([checkpoints.single, checkpoints.other])
    mine, theirs = dead.segments()
    dead.kill()
    os.chown(mine, NOBODY, NOBODY)
    size = os.stat(mine).st_size
    as_nobody = [setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]

    result = subprocess.run(
        [*as_nobody, *cli_command(), "gc"],
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env(),
        check=False,
    )

    assert (result.returncode, result.stderr) == (0, "")
    assert _gc_lines(result, [mine, theirs]) == [
        f"removed {mine} ({size} bytes, daemon pid {dead.pid})"
    ]
    assert dead.segments() == [theirs]

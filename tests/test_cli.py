"""The ``weightcache`` command against a real daemon."""

from __future__ import annotations

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

"""The ``weightcache`` command against a real daemon."""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.support import (
    POLL,
    READY_TIMEOUT,
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
    shm_segments,
    short_tempdir,
)
from weightcache.core.sockets import default_socket
from weightcache.core.sockets import segment_tag as socket_tag
from weightcache.testing.daemon import list_models, wait_or_kill
from weightcache_service.admin import human_bytes
from weightcache_service.cli import _parser, client_socket, daemon_socket


@pytest.fixture(scope="module")
def daemon(module_daemons: DaemonPool, checkpoints: Checkpoints) -> Daemon:
    return module_daemons.start([checkpoints.single])


def _ls_rows(socket: str) -> list[dict[str, str]]:
    result = run_cli("ls", "--socket", socket)
    assert (result.returncode, result.stderr) == (0, "")
    lines = result.stdout.splitlines()
    header = lines[0].split()
    # SOURCE, last, may hold a space ("peer HOST:PORT").
    rows = [line.split(maxsplit=len(header) - 1) for line in lines[1:]]
    assert header == [
        "NAME",
        "STATE",
        "PROGRESS",
        "SIZE",
        "TENSORS",
        "LEASES",
        "DTYPE",
        "FINGERPRINT",
        "SOURCE",
    ]
    return [dict(zip(header, row, strict=True)) for row in rows]


def test_health_serving(daemon: Daemon) -> None:
    result = run_cli("health", "--socket", daemon.socket)

    assert (result.returncode, result.stdout) == (0, "SERVING\n")


def test_health_without_daemon_fails(module_daemons: DaemonPool) -> None:
    socket = module_daemons.socket("absent")
    result = run_cli("health", "--socket", socket, "--timeout", "2")

    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr.startswith(f"weightcache health: no daemon socket at {socket} (")


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
        "PROGRESS": "-",
        "SIZE": human_bytes(model.size_bytes),
        "TENSORS": "9",
        "LEASES": "1",
        "DTYPE": "-",
        "FINGERPRINT": model.fingerprint.digest[:16],
        "SOURCE": "checkpoint",
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


# -- one socket rule for the daemon, the admin commands and the units (issue 15) -------

NOBODY_UID = 65534
GPU_UUID = "GPU-8f3c1a2b-0000-4000-8000-000000000001"
RULE_VARIABLES = ("WEIGHTCACHE_SOCKET", "WEIGHTCACHE_RUNTIME_DIR", "XDG_RUNTIME_DIR")


def _as_user(uid: int) -> list[str]:
    """A command prefix running as ``uid`` (nothing for this process's own uid)."""
    if uid == os.geteuid():
        return []
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        pytest.skip("needs root and setpriv(1) to run as another user")
    return [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]


def _cli_as(prefix: list[str], env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*prefix, *cli_command(), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
        cwd="/",
    )


@contextlib.contextmanager
def _default_socket_daemon(
    prefix: list[str], env: dict[str, str], models: list[str], log: Path
) -> Iterator[subprocess.Popen[bytes]]:
    """``weightcache preload MODELS --device cpu`` without ``--socket``; SIGTERMed after,
    and it must exit 0."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [*prefix, *cli_command(), "preload", *models, "--device", "cpu"],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd="/",
        )
    try:
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        assert not wait_or_kill(proc), "ignored SIGTERM: " + log.read_text(errors="replace")
        assert proc.returncode == 0, log.read_text(errors="replace")


def _world_readable_copy(folder: Path) -> Path:
    """``folder`` copied where another user can read it (pytest's folders are 0700)."""
    root = short_tempdir()
    root.chmod(0o755)
    copy = root / folder.name
    shutil.copytree(folder, copy)
    for path in (copy, *copy.iterdir()):
        path.chmod(0o755 if path.is_dir() else 0o644)
    return copy


@pytest.mark.parametrize("variable", ["XDG_RUNTIME_DIR", "WEIGHTCACHE_RUNTIME_DIR"])
def test_ls_by_device_reaches_a_daemon_on_its_default_socket(
    variable: str, checkpoints: Checkpoints, tmp_path: Path
) -> None:
    """Neither the daemon nor ``ls`` is given ``--socket``: both name ``cpu.sock`` in the
    runtime dir. ``XDG_RUNTIME_DIR`` counts for a user other than root only, so as root
    both run as nobody then."""
    as_root = os.geteuid() == 0
    uid = NOBODY_UID if variable == "XDG_RUNTIME_DIR" and as_root else os.geteuid()
    prefix = _as_user(uid)
    runtime = short_tempdir()
    model = _world_readable_copy(checkpoints.single)
    try:
        os.chown(runtime, uid, uid)
        env = {k: v for k, v in child_env().items() if k not in RULE_VARIABLES}
        env[variable] = str(runtime)
        folder = runtime / "weightcache" if variable == "XDG_RUNTIME_DIR" else runtime
        expected = str(folder / "cpu.sock")
        with _default_socket_daemon(prefix, env, [str(model)], tmp_path / "daemon.log") as proc:
            deadline = time.monotonic() + READY_TIMEOUT
            while _cli_as(prefix, env, "health", "--device", "cpu").stdout != "SERVING\n":
                assert proc.poll() is None and time.monotonic() < deadline, (
                    tmp_path / "daemon.log"
                ).read_text()
                time.sleep(POLL)

            result = _cli_as(prefix, env, "ls", "--device", "cpu")

            assert (result.returncode, result.stderr) == (0, "")
            header, row = (line.split() for line in result.stdout.splitlines())
            assert (header[:2], row[:2]) == (["NAME", "STATE"], ["single", "READY"])
            assert os.stat(expected).st_uid == uid
            assert health(expected) == "SERVING"  # the path the rule names, asked directly
        assert not os.path.lexists(expected)
        assert shm_segments(socket_tag(expected)) == []
    finally:
        shutil.rmtree(runtime, ignore_errors=True)
        shutil.rmtree(model.parent, ignore_errors=True)


def test_admin_socket_wins_over_device(daemon: Daemon) -> None:
    """``--socket`` is used as given: a GPU ``--device`` beside it is never resolved."""
    result = run_cli("info", "--socket", daemon.socket, "--device", "cuda:7")

    assert (result.returncode, result.stderr) == (0, "")
    assert "backend: cpu_shm\n" in result.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="asserts the refusal without a GPU")
@pytest.mark.parametrize("command", ["ls", "info", "health", "evict"])
def test_admin_gpu_device_without_cuda_is_device_not_visible(command: str) -> None:
    extra = ["some-model"] if command == "evict" else []
    result = run_cli(command, *extra, "--device", "cuda:0")

    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr.startswith(
        f"weightcache {command}: DEVICE_NOT_VISIBLE: device cuda:0: torch {torch.__version__} "
        "sees no CUDA/ROCm device, so its UUID (which names its daemon's socket) cannot be read"
    )


def test_admin_device_that_names_none_is_a_usage_error() -> None:
    result = run_cli("ls", "--device", "mps")

    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (
        "weightcache ls: device 'mps': use cpu, cuda:N, N, cuda, a GPU-/MIG- UUID, an index "
        "or a torch.device\n"
    )


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_systemd_units_and_the_cli_agree_on_the_socket(
    unit: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon a unit starts, ``weightcache health`` with the same ``--device`` and a
    worker of the same device all name one socket, by the rule: no ``--socket`` anywhere,
    one ``--device``, and the runtime dir that ``RuntimeDirectory=`` creates. The template
    is read for a UUID instance, whose socket needs no GPU to name."""
    service = _service_section(unit)
    start = [a for a in shlex.split(service["ExecStart"][0])[1:] if not a.startswith("$")]
    daemon_args = _parser().parse_args([a.replace("%i", GPU_UUID) for a in start])
    device_arg = daemon_args.device
    probe_args = _parser().parse_args(["health", "--device", device_arg])
    environment = dict(kv.split("=", 1) for line in service["Environment"] for kv in line.split())
    for name in RULE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    device = "cpu" if unit.name == "weightcache.service" else GPU_UUID
    expected = (
        f"/run/{service['RuntimeDirectory'][0]}/{'cpu' if device == 'cpu' else GPU_UUID}.sock"
    )

    assert (daemon_args.socket, probe_args.socket) == (None, None)
    assert daemon_args.device == device
    assert (service["Type"], service["NotifyAccess"]) == (["notify"], ["main"])
    assert "ExecStartPost" not in service  # readiness is sd_notify's READY=1
    assert environment["WEIGHTCACHE_RUNTIME_DIR"] == f"/run/{service['RuntimeDirectory'][0]}"
    assert client_socket(probe_args) == expected
    assert default_socket(device) == expected  # a worker's load(path, device=...)
    if device == "cpu":  # a GPU daemon checks first that it sees its device
        assert daemon_socket(daemon_args) == expected


def test_seed_from_without_peer_tls_is_refused_at_start_and_in_a_preload(
    daemons: DaemonPool, checkpoints: Checkpoints
) -> None:
    # Before (issue 37, item 17): the daemon started silently and every seed failed later
    # with UNAVAILABLE "Socket closed". Refused at once now, saying what is missing.
    started = run_cli("preload", str(checkpoints.single), "--seed-from", "peer.example:7443")
    assert (started.returncode, started.stdout) == (2, "")
    assert started.stderr == (
        "weightcache preload: --seed-from needs --peer-tls-cert, --peer-tls-key and "
        "--peer-tls-ca (peers seed only over mutual TLS; docs/seeding.md shows how to make "
        "the certificates)\n"
    )
    daemon = daemons.start(
        args=["--allow-remote-preload", "--model-root", str(checkpoints.single.parent)]
    )

    loaded = run_cli(
        "load",
        str(checkpoints.single),
        "--seed-from",
        "peer.example:7443",
        "--socket",
        daemon.socket,
    )

    assert (loaded.returncode, loaded.stdout) == (1, "")
    assert loaded.stderr == (
        "weightcache load: INVALID_ARGUMENT: seeding from peer.example:7443 needs mutual TLS: "
        "start the daemon with --peer-tls-cert, --peer-tls-key and --peer-tls-ca "
        "(docs/seeding.md)\n"
    )


def test_evict_takes_a_path_and_a_pickled_only_folder_is_named_as_such(
    daemons: DaemonPool, checkpoints: Checkpoints, tmp_path: Path
) -> None:
    # Before (issue 37, item 18): `evict PATH` said MODEL_NOT_FOUND (names only), and a
    # folder of .bin files was refused without a word about them.
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    torch.save({"w": torch.zeros(2)}, pickled / "pytorch_model.bin")
    daemon = daemons.start([checkpoints.single, pickled])

    [failed] = [m for m in list_models(daemon.socket) if m.name == "pickled"]
    by_path = run_cli("evict", str(checkpoints.single), "--socket", daemon.socket)
    nothing = run_cli("evict", str(tmp_path), "--socket", daemon.socket)

    assert failed.error == (
        f"INVALID_CHECKPOINT: {pickled}: neither model.safetensors nor "
        "model.safetensors.index.json found; it holds pickled PyTorch weights "
        "(pytorch_model.bin), which are not read (unpickling runs code): save them as "
        "safetensors first (transformers: save_pretrained(..., safe_serialization=True))"
    )
    assert (by_path.returncode, by_path.stdout, by_path.stderr) == (0, "evicted single\n", "")
    assert (nothing.returncode, nothing.stdout, nothing.stderr) == (
        1,
        "",
        f"weightcache evict: MODEL_NOT_FOUND: no model is loaded from {tmp_path} "
        "(weightcache ls lists them)\n",
    )
    assert [m.name for m in list_models(daemon.socket)] == ["pickled"]

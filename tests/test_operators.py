"""What an operator sees of a real daemon's decisions (issue 28): start-up models that
failed before they held anything stay listed with their reason (``ls``, ``health``,
metrics); refusals are logged, structured and rate-limited; who holds each lease
(``weightcache leases``, with the credentials the kernel gives the daemon)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket as socketlib
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from tests.support import (
    Checkpoints,
    DaemonPool,
    WorkerPool,
    assert_attached,
    child_env,
    cli_command,
    rpc_failure,
    run_cli,
    service_stub,
    write_malformed,
)
from tests.test_probes import scrape
from weightcache.core.version import __version__
from weightcache.testing.daemon import list_models
from weightcache.v1 import weight_cache_service_pb2 as pb
from weightcache_service.admin import human_bytes
from weightcache_service.refusals import RefusalLog

#: The header of ``weightcache leases``, split at blanks.
HEADER = ["LEASE", "MODEL", "STATE", "MODE", "AGE", "TTL", "UID", "PID", "WORKER", "PID", "HOST"]
HEADER += ["LABEL"]


def run_cli_env(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``weightcache ARGS`` with ``env`` added to its environment."""
    return subprocess.run(
        [*cli_command(), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env(env),
        check=False,
    )


def log_events(text: str, event: str) -> list[dict[str, Any]]:
    """The JSON log lines (``--log-format json``) of ``event``."""
    lines = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    return [line for line in lines if line.get("event") == event]


# -- 1. failed start-up models stay listed -----------------------------------------------


@pytest.fixture(scope="module")
def failed_start(
    module_daemons: DaemonPool, checkpoints: Checkpoints, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Any, int, dict[str, str]]:
    """A daemon started with a typo'd path, a truncated checkpoint and a good one."""
    root = tmp_path_factory.mktemp("failed-start")
    broken = write_malformed(root / "broken", "bad-header-length")
    missing = root / "mising-model"
    daemon = module_daemons.start(
        [missing, broken, checkpoints.single],
        args=["--metrics-listen", "127.0.0.1:0", "--log-format", "json"],
    )
    return daemon, daemon.bound_port("metrics"), {"missing": str(missing), "broken": str(broken)}


def test_failed_start_up_models_are_listed_with_their_reason(
    failed_start: tuple[Any, int, dict[str, str]],
) -> None:
    daemon, _, paths = failed_start

    models = {m.name: m for m in list_models(daemon.socket)}
    ls = run_cli("ls", "--json", "--socket", daemon.socket)

    assert {name: pb.ModelState.Name(m.state) for name, m in models.items()} == {
        "broken": "MODEL_STATE_FAILED",
        "mising-model": "MODEL_STATE_FAILED",
        "single": "MODEL_STATE_READY",
    }
    assert models["mising-model"].path == paths["missing"]
    assert models["mising-model"].error.startswith("INVALID_CHECKPOINT: ")
    assert paths["missing"] in models["mising-model"].error
    assert models["broken"].error.startswith("INVALID_CHECKPOINT: ")
    assert "runs past the end" in models["broken"].error
    assert (models["broken"].size_bytes, models["broken"].fingerprint.digest) == (0, "")
    assert ls.returncode == 0
    listed = {m["name"]: m for m in json.loads(ls.stdout)["models"]}
    assert listed["broken"]["error"] == models["broken"].error
    [ready] = log_events(daemon.log(), "ready")
    assert (ready["models"], ready["failed"]) == (1, 2)


def test_health_prints_why_it_is_not_ready(failed_start: tuple[Any, int, dict[str, str]]) -> None:
    daemon, _, _ = failed_start
    models = {m.name: m for m in list_models(daemon.socket)}

    result = run_cli("health", "--socket", daemon.socket)
    liveness = run_cli("health", "--liveness", "--socket", daemon.socket)

    assert (result.returncode, result.stderr) == (1, "")
    assert result.stdout == (
        "NOT_SERVING\n"
        f"broken FAILED: {models['broken'].error}\n"
        f"mising-model FAILED: {models['mising-model'].error}\n"
    )
    assert (liveness.returncode, liveness.stdout) == (0, "SERVING\n")


def test_metrics_count_the_failed_start_up_models(
    failed_start: tuple[Any, int, dict[str, str]],
) -> None:
    _, port, _ = failed_start

    samples = scrape(port)

    assert samples["weightcache_ready", ()] == 0  # required models FAILED
    assert samples["process_resident_memory_bytes", ()] > 0
    assert samples["process_open_fds", ()] > 0
    assert 0 < samples["process_start_time_seconds", ()] <= time.time()
    assert samples["weightcache_models", (("state", "failed"),)] == 2
    assert samples["weightcache_models", (("state", "ready"),)] == 1
    refused = (("reason", "INVALID_CHECKPOINT"), ("result", "refused"))
    assert samples["weightcache_preloads_total", refused] == 2
    assert samples["weightcache_preloads_total", (("reason", ""), ("result", "ready"))] == 1


def test_a_failed_start_up_model_is_evicted_like_any_failed_model(
    daemons: DaemonPool, tmp_path: Path
) -> None:
    daemon = daemons.start([tmp_path / "absent"])

    evicted = run_cli("evict", "absent", "--socket", daemon.socket)

    assert (evicted.returncode, evicted.stdout, evicted.stderr) == (0, "evicted absent\n", "")
    assert list_models(daemon.socket) == []


# -- 2. refusals are logged --------------------------------------------------------------


def test_refusals_are_logged_structured_and_rate_limited(
    daemons: DaemonPool, workers: WorkerPool, checkpoints: Checkpoints
) -> None:
    daemon = daemons.start([checkpoints.single], args=["--log-format", "json"])
    worker = workers.start()

    # At level "layout" the worker's fingerprint differs from the daemon's "full" one.
    first = worker.load(checkpoints.single, socket=daemon.socket, fingerprint_level="layout")
    second = worker.load(
        checkpoints.single, socket=daemon.socket, fingerprint_level="layout", key="again"
    )
    with service_stub(daemon.socket) as stub, pytest.raises(grpc.RpcError) as evict:
        stub.Evict(pb.EvictRequest(name="nosuch"), timeout=10)

    assert first["source"] == second["source"] == "disk"
    assert first["fallback_reason"]["code"] == "FINGERPRINT_MISMATCH"
    assert rpc_failure(evict.value).reason == "MODEL_NOT_FOUND"
    refused = log_events(daemon.log(), "refused")
    [acquire] = [line for line in refused if line["rpc"] == "Acquire"]
    assert acquire["reason"] == "FINGERPRINT_MISMATCH"
    assert acquire["level"] == "warning"
    assert acquire["model"] == "single"
    assert acquire["path"] == str(checkpoints.single.resolve())
    assert acquire["fingerprint_level"] == "LAYOUT"
    assert acquire["match"] == "fingerprint"
    assert acquire["components"] == "checkpoint/model.safetensors,format"
    assert acquire["error"] == (
        "held model 'single' was fingerprinted at level 'full', this request at level "
        "'layout': a fingerprint at another level differs in every checkpoint file, whether "
        "or not the files changed; load with fingerprint_level='full' (the daemon's "
        "--fingerprint-level)"
    )
    assert (acquire["pid"], acquire["peer_pid"], acquire["peer_uid"]) == (
        worker.pid,
        worker.pid,
        os.getuid(),
    )
    assert acquire["hostname"] == socketlib.gethostname()
    assert acquire["suppressed"] == 0
    [evicted] = [line for line in refused if line["rpc"] == "Evict"]
    assert (evicted["reason"], evicted["model"]) == ("MODEL_NOT_FOUND", "nosuch")


def test_refusal_log_writes_one_line_per_kind_per_interval() -> None:
    now = [0.0]
    log = RefusalLog(clock=lambda: now[0], interval=10.0)

    written = [log.refused("Acquire", "MODEL_NOT_FOUND", "x", path="/m") for _ in range(3)]
    other = log.refused("Acquire", "MODEL_NOT_FOUND", "x", path="/n")
    now[0] = 10.0
    later = log.refused("Acquire", "MODEL_NOT_FOUND", "x", path="/m")

    assert (written, other, later) == ([True, False, False], True, True)


# -- 4. who holds a lease ----------------------------------------------------------------


def test_leases_name_their_holders(
    daemons: DaemonPool, workers: WorkerPool, checkpoints: Checkpoints
) -> None:
    daemon = daemons.start([checkpoints.single, checkpoints.other])
    holder = workers.start(env={"WEIGHTCACHE_LABEL": "ns/pod-7"})
    assert_attached(holder.load(checkpoints.single, socket=daemon.socket, ttl=30.0))
    assert_attached(holder.load(checkpoints.other, socket=daemon.socket, key="o", mode="copy"))

    listed = run_cli("leases", "--json", "--socket", daemon.socket)
    single = run_cli("leases", "single", "--socket", daemon.socket)

    assert (listed.returncode, listed.stderr) == (0, "")
    leases = json.loads(listed.stdout)["leases"]
    assert [lease["lease"]["model"] for lease in leases] == ["single"]  # copy mode released
    [lease] = leases
    assert lease["state"] == "LEASE_STATE_ACTIVE"
    assert lease["lease"]["ttl"] == "30s"
    assert lease["worker"] == {
        "pid": holder.pid,
        "hostname": socketlib.gethostname(),
        "label": "ns/pod-7",
        "pid_namespace": os.stat("/proc/self/ns/pid").st_ino,
        "mode": "zero_copy",
    }
    assert lease["peer"] == {"pid": holder.pid, "uid": os.getuid(), "gid": os.getgid()}
    assert (single.returncode, single.stderr) == (0, "")
    header, row = single.stdout.splitlines()
    assert header.split() == HEADER
    cells = row.split()
    assert cells[0] == lease["lease"]["lease_id"][:8]
    assert cells[1:4] + cells[5:] == [
        "single", "ACTIVE", "zero_copy", "30s", str(os.getuid()), str(holder.pid),
        str(holder.pid), socketlib.gethostname(), "ns/pod-7",
    ]  # fmt: skip


def test_leases_of_a_model_not_held_are_none(daemons: DaemonPool) -> None:
    daemon = daemons.start()

    result = run_cli("leases", "nosuch", "--socket", daemon.socket)

    assert (result.returncode, result.stdout.split(), result.stderr) == (
        0,
        [*HEADER],
        "",
    )


# -- 6. messages that lead to the fix ------------------------------------------------------


def test_no_socket_names_the_rule_and_the_variables(tmp_path: Path) -> None:
    socket = str(tmp_path / "cpu.sock")
    env = {"WEIGHTCACHE_RUNTIME_DIR": str(tmp_path)}

    result = run_cli_env("ls", env=env)

    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr == (
        f"weightcache ls: DAEMON_UNAVAILABLE: no daemon socket at {socket} (named by the "
        f"runtime dir {tmp_path} ($WEIGHTCACHE_RUNTIME_DIR, else /run/weightcache as root, "
        "$XDG_RUNTIME_DIR/weightcache, /tmp/weightcache-<uid>)); a process that does not "
        "run as the daemon's user sets $WEIGHTCACHE_RUNTIME_DIR or $WEIGHTCACHE_SOCKET to "
        "the daemon's\n"
    )


def test_a_stale_socket_says_no_daemon(tmp_path: Path) -> None:
    socket = str(tmp_path / "stale.sock")
    with socketlib.socket(socketlib.AF_UNIX) as stale:
        stale.bind(socket)  # bound, never listening: what a daemon killed leaves

    result = run_cli("ls", "--socket", socket)

    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr.startswith(
        "weightcache ls: DAEMON_UNAVAILABLE: no daemon (stale socket: nothing listens on it): "
    )


def test_a_socket_of_another_user_names_the_group_rule(daemons: DaemonPool) -> None:
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        pytest.skip("needs root and setpriv(1) to connect as another user")
    daemon = daemons.start()
    os.chmod(os.path.dirname(daemon.socket), 0o755)  # the folder open, the socket 0600

    as_nobody = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups"]
    result = subprocess.run(
        [*as_nobody, *cli_command(), "ls", "--socket", daemon.socket],
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env(),
        check=False,
    )

    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr.startswith(
        "weightcache ls: DAEMON_UNAVAILABLE: daemon unavailable: the socket is the daemon's "
        "user's only, unless the daemon runs with --group GROUP and this process is in that "
        "group: "
    )


# -- 11. small things --------------------------------------------------------------------


def test_human_bytes() -> None:
    assert [human_bytes(n) for n in (0, 512, 1536, 40 * 2**20, int(7.25 * 2**30), 2**50)] == [
        "0B",
        "512B",
        "1.5KiB",
        "40.0MiB",
        "7.2GiB",
        "1024.0TiB",
    ]


def test_info_says_unlimited_and_json_keeps_numbers(
    failed_start: tuple[Any, int, dict[str, str]],
) -> None:
    daemon, _, _ = failed_start

    info = run_cli("info", "--socket", daemon.socket)
    as_json = run_cli("info", "--json", "--socket", daemon.socket)
    ls = run_cli("ls", "--json", "--socket", daemon.socket)

    assert info.returncode == as_json.returncode == ls.returncode == 0
    assert "memory_budget_bytes: unlimited\n" in info.stdout
    held = json.loads(as_json.stdout)["memory_held_bytes"]
    assert isinstance(held, int) and held > 0
    assert f"memory_held_bytes: {held} ({human_bytes(held)})\n" in info.stdout
    [single] = [m for m in json.loads(ls.stdout)["models"] if m["name"] == "single"]
    assert isinstance(single["size_bytes"], int)
    assert isinstance(single["progress"]["bytes_total"], int)
    assert isinstance(single["create_time"], str)  # a Timestamp keeps its RFC 3339 text


def test_gc_dry_run_says_when_there_is_nothing() -> None:
    # A /dev/shm of its own would need a mount namespace: on a shared machine other dead
    # daemons' segments may exist, so only the empty case's line is checked when it holds.
    result = run_cli("gc", "--dry-run")

    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout != ""
    if not result.stdout.startswith("would remove"):
        assert result.stdout == "no segment of a dead daemon: nothing to remove\n"


def test_start_up_and_signal_lines(daemons: DaemonPool, checkpoints: Checkpoints) -> None:
    daemon = daemons.start([checkpoints.single], args=["--log-format", "json"])
    assert daemon.stop() == 0

    [started] = log_events(daemon.log(), "started")
    [received] = log_events(daemon.log(), "received signal: draining")

    assert (started["backend"], started["device"], started["device_uuid"]) == ("cpu_shm", "cpu", "")
    assert started["version"] == __version__
    assert started["torch"] == torch.__version__
    assert started["models"] == started["required"] == [str(checkpoints.single)]
    assert started["argv"][:3] == ["preload", str(checkpoints.single), "--log-format"]
    assert (received["signal"], received["pid"], received["level"]) == (
        "SIGTERM",
        daemon.pid,
        "info",
    )


def test_load_of_a_model_held_ready_succeeds(daemons: DaemonPool, checkpoints: Checkpoints) -> None:
    root = checkpoints.single.parent
    daemon = daemons.start(
        [checkpoints.single], args=["--allow-remote-preload", "--model-root", str(root)]
    )
    total = list_models(daemon.socket)[0].progress.bytes_total

    again = run_cli("load", str(checkpoints.single), "--socket", daemon.socket)

    assert (again.returncode, again.stdout) == (0, f"single READY {total} bytes (already held)\n")


# -- 10. the dashboard and the alert rules name only what the daemon exports ------------

MONITORING = Path(__file__).resolve().parent.parent / "deploy" / "monitoring"
#: Series Prometheus makes itself, which the rules may name.
PROMETHEUS_OWN = {"up"}


def _exported_names(port: int) -> set[str]:
    """Every series name the daemon's exposition declares, parsed with prometheus-client's
    parser (a labelled family without samples yet is declared all the same)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum")}
    names = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names.update(family.name + s for s in suffixes.get(family.type, ()))
        names.update(sample.name for sample in family.samples)
    return names


def _named(expr: str) -> set[str]:
    return set(re.findall(r"\b(weightcache_[a-z_]+|process_[a-z_]+|up)\b", expr))


def test_the_dashboard_and_alerts_name_only_exported_metrics(daemons: DaemonPool) -> None:
    # With a budget (without one, weightcache_memory_budget_bytes is +Inf).
    daemon = daemons.start(args=["--metrics-listen", "127.0.0.1:0", "--max-memory", "1GiB"])
    port = daemon.bound_port("metrics")
    dashboard = json.loads((MONITORING / "weightcache-dashboard.json").read_text())
    rules = yaml.safe_load((MONITORING / "weightcache-alerts.yml").read_text())
    exported = _exported_names(port) | PROMETHEUS_OWN

    panel_exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    rule_exprs = [rule["expr"] for group in rules["groups"] for rule in group["rules"]]

    assert len(panel_exprs) >= 9 and len(rule_exprs) >= 5
    assert all(_named(expr) for expr in panel_exprs + rule_exprs)
    assert {n for e in panel_exprs + rule_exprs for n in _named(e)} - exported == set()
    assert [p["id"] for p in dashboard["panels"]] == list(range(1, len(dashboard["panels"]) + 1))


#: Where `make promtool` unpacks Debian's promtool (not installed).
PROMTOOL = MONITORING.parent.parent / ".build" / "prometheus" / "usr" / "bin" / "promtool"


def test_per_model_series_name_each_model_its_state_bytes_and_leases(
    daemons: DaemonPool, workers: WorkerPool, checkpoints: Checkpoints, tmp_path: Path
) -> None:
    missing = tmp_path / "mising-model"
    daemon = daemons.start([checkpoints.single, missing], args=["--metrics-listen", "127.0.0.1:0"])
    port = daemon.bound_port("metrics")
    assert_attached(workers.start().load(checkpoints.single, socket=daemon.socket))
    size = {m.name: m.size_bytes for m in list_models(daemon.socket)}

    samples = scrape(port)

    per_model = {k: v for k, v in samples.items() if k[0].startswith("weightcache_model_")}
    states = ("evicting", "failed", "loading", "ready")
    expected: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {
        **{
            ("weightcache_model_state", (("model", "single"), ("state", s))): float(s == "ready")
            for s in states
        },
        **{
            ("weightcache_model_state", (("model", "mising-model"), ("state", s))): float(
                s == "failed"
            )
            for s in states
        },
        ("weightcache_model_bytes", (("model", "single"),)): size["single"],
        ("weightcache_model_bytes", (("model", "mising-model"),)): 0.0,
        ("weightcache_model_leases", (("model", "single"),)): 1.0,
        ("weightcache_model_leases", (("model", "mising-model"),)): 0.0,
    }
    assert per_model == expected
    assert size["single"] > 0
    assert samples["weightcache_memory_budget_bytes", ()] == float("inf")  # no --max-memory
    assert samples["process_resident_memory_bytes", ()] > 0


def test_the_alert_rules_pass_promtool() -> None:
    promtool = str(PROMTOOL) if PROMTOOL.is_file() else shutil.which("promtool")
    if promtool is None:
        pytest.skip("no promtool: `make promtool` (part of `make test`) fetches Debian's")

    result = subprocess.run(
        [promtool, "check", "rules", str(MONITORING / "weightcache-alerts.yml")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )

    assert result.returncode == 0, result.stdout + result.stderr


# -- 9. PROMETHEUS_MULTIPROC_DIR and IPv6 ------------------------------------------------


def test_metrics_ignore_a_multiprocess_dir_and_listen_on_both_stacks(
    daemons: DaemonPool, checkpoints: Checkpoints, tmp_path: Path
) -> None:
    """``[::]`` serves IPv4 and IPv6 (the manifests' address); a PROMETHEUS_MULTIPROC_DIR
    set for another application is ignored (said in the log), whether or not it exists."""
    other_app = tmp_path / "other-app"
    other_app.mkdir()
    listen = ["--metrics-listen", "[::]:0", "--health-listen", "[::]:0"]
    daemon = daemons.start(
        [checkpoints.single],
        args=[*listen, "--log-format", "json"],
        env={"PROMETHEUS_MULTIPROC_DIR": str(other_app)},
    )
    port, health_port = daemon.bound_port("metrics"), daemon.bound_port("health")

    for host in ("127.0.0.1", "[::1]"):
        url = f"http://{host}:{port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as reply:
            text = reply.read().decode()
        families = {f.name: f for f in text_string_to_metric_families(text)}
        assert [s.value for s in families["weightcache_leases_active"].samples] == [0.0]
        with grpc.insecure_channel(f"{host}:{health_port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            status = stub.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=10)
        assert status.status == health_pb2.HealthCheckResponse.SERVING
    assert list(other_app.iterdir()) == []
    [ignored] = log_events(daemon.log(), "ignored: the daemon's metrics are one process's")
    assert (ignored["variable"], ignored["value"]) == ("PROMETHEUS_MULTIPROC_DIR", str(other_app))


def test_metrics_on_0_0_0_0_listen_on_both_stacks_as_health_does(
    daemons: DaemonPool,
) -> None:
    """Before (issue 37, item 13): ``--metrics-listen 0.0.0.0:P`` served IPv4 only, while
    ``--health-listen 0.0.0.0:P`` (gRPC) serves both families."""
    listen = ["--metrics-listen", "0.0.0.0:0", "--health-listen", "0.0.0.0:0"]
    daemon = daemons.start(args=listen)
    port, health_port = daemon.bound_port("metrics"), daemon.bound_port("health")

    for host in ("127.0.0.1", "[::1]"):
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        families = {f.name: f for f in text_string_to_metric_families(text)}
        assert [s.value for s in families["weightcache_leases_active"].samples] == [0.0]
        with grpc.insecure_channel(f"{host}:{health_port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            status = stub.Check(health_pb2.HealthCheckRequest(service="liveness"), timeout=10)
        assert status.status == health_pb2.HealthCheckResponse.SERVING


def test_a_missing_multiprocess_dir_does_not_break_the_metrics(
    daemons: DaemonPool, tmp_path: Path
) -> None:
    daemon = daemons.start(
        args=["--metrics-listen", "127.0.0.1:0"],
        env={"PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "absent")},
    )
    port = daemon.bound_port("metrics")

    samples = scrape(port)

    assert samples["weightcache_leases_active", ()] == 0
    assert "No such file or directory" not in daemon.log()


# -- 3. what the Acquire counter means ---------------------------------------------------


def test_a_copy_attached_counts_a_probe_miss_not_a_refusal(
    daemons: DaemonPool, workers: WorkerPool, checkpoints: Checkpoints, tmp_path: Path
) -> None:
    daemon = daemons.start([checkpoints.single], args=["--metrics-listen", "127.0.0.1:0"])
    port = daemon.bound_port("metrics")
    copy = tmp_path / "copy"
    shutil.copytree(checkpoints.single, copy)  # other files: the probe by identity misses

    assert_attached(workers.start().load(copy, socket=daemon.socket))

    samples = scrape(port)
    assert samples["weightcache_ready", ()] == 1
    acquires = {k: v for k, v in samples.items() if k[0] == "weightcache_acquires_total"}
    assert acquires == {
        ("weightcache_acquires_total", (("reason", ""), ("result", "granted"))): 1.0,
        (
            "weightcache_acquires_total",
            (("reason", "MODEL_NOT_FOUND"), ("result", "probe_missed")),
        ): 1.0,
    }


#: The default worker, with the standard logging configured to show each record's level.
LEVELLED_WORKER = (
    sys.executable,
    "-c",
    "import logging, runpy; "
    "logging.basicConfig(level=logging.INFO, format='%(levelname)s %(message)s'); "
    "runpy.run_module('weightcache.testing.worker', run_name='__main__')",
)


def test_a_lease_lost_on_shared_memory_under_ignore_is_a_warning(
    daemons: DaemonPool, checkpoints: Checkpoints, tmp_path: Path
) -> None:
    """On CPU (policy ``ignore``) a lost lease loses nothing the worker reads: logged at
    WARNING, not ERROR. The daemon is stopped (SIGSTOP) past the lease's validity, then
    resumed."""
    daemon = daemons.start([checkpoints.single])
    pool = WorkerPool(tmp_path, command=LEVELLED_WORKER)
    try:
        worker = pool.start()
        assert_attached(worker.load(checkpoints.single, socket=daemon.socket, ttl=1.0))
        assert worker.request("wait_ack", key="w", seconds=10.0)["ok"]
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            lost = worker.request("wait_lost", key="w", seconds=20.0)
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
    finally:
        pool.close()

    assert (lost["fired"], lost["tensors_error"]) == (True, None)
    lines = [line for line in worker.log().splitlines() if "lease lost" in line]
    assert len(lines) == 1
    assert lines[0].startswith("WARNING lease lost lease=")
    assert lines[0].endswith(" policy='ignore'")

"""Operations: the health-only TCP listener (Kubernetes ``grpc:`` probes), readiness and
liveness, and the Prometheus metrics of a real daemon, probed and scraped over TCP with
the stock clients (the ``grpc.health.v1`` stub, prometheus-client's parser)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket as socketlib
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from tests.support import (
    Checkpoints,
    DaemonPool,
    WorkerPool,
    assert_attached,
    get_model,
    rpc_failure,
    run_cli,
    service_stub,
    wait_until,
    write_malformed,
)
from weightcache.core.rpc import SERVICE_NAME
from weightcache.core.version import __version__
from weightcache.v1 import weight_cache_service_pb2 as pb
from weightcache.v1 import weight_cache_service_pb2_grpc as pb_grpc
from weightcache_service.admin import NO_MODEL_TO_BLAME

SERVICES = ("", "readiness", "liveness", SERVICE_NAME)


@contextlib.contextmanager
def health_stub(port: int) -> Iterator[health_pb2_grpc.HealthStub]:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield health_pb2_grpc.HealthStub(channel)


def statuses(port: int) -> dict[str, str]:
    """Each service's status name, asked over the health-only TCP listener."""
    out = {}
    with health_stub(port) as stub:
        for service in SERVICES:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            out[service] = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return out


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of ``/metrics``, by name and sorted labels."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_health_listener_serves_health_only(daemons: DaemonPool, checkpoints: Checkpoints) -> None:
    daemon = daemons.start([checkpoints.single], args=["--health-listen", "127.0.0.1:0"])
    port = daemon.bound_port("health")
    wait_until(lambda: statuses(port)["readiness"] == "SERVING", timeout=30)

    assert statuses(port) == dict.fromkeys(SERVICES, "SERVING")
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.WeightCacheServiceStub(channel)
        with pytest.raises(grpc.RpcError) as raised:
            stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    assert raised.value.code() == grpc.StatusCode.UNIMPLEMENTED
    with health_stub(port) as stub, pytest.raises(grpc.RpcError) as unknown:
        stub.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=10)
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    # The same statuses on the Unix socket, through the CLI (exec probes).
    ready = run_cli("health", "--socket", daemon.socket)
    alive = run_cli("health", "--liveness", "--socket", daemon.socket)
    assert (ready.returncode, ready.stdout) == (0, "SERVING\n")
    assert (alive.returncode, alive.stdout) == (0, "SERVING\n")


def test_failed_required_preload_keeps_the_daemon_unready(
    daemons: DaemonPool, checkpoints: Checkpoints, tmp_path: Path
) -> None:
    bad = write_malformed(tmp_path / "bad", "invalid-json")
    daemon = daemons.start(
        [checkpoints.single, bad], args=["--health-listen", "127.0.0.1:0"]
    )  # waits for the start-up preloads to end
    port = daemon.bound_port("health")

    assert statuses(port) == {
        "": "NOT_SERVING",
        "readiness": "NOT_SERVING",
        "liveness": "SERVING",
        SERVICE_NAME: "SERVING",
    }
    ready = run_cli("health", "--readiness", "--socket", daemon.socket)
    alive = run_cli("health", "--liveness", "--socket", daemon.socket)
    bad_model = get_model(daemon.socket, "bad")
    assert bad_model.state == pb.MODEL_STATE_FAILED
    assert (ready.returncode, ready.stdout) == (
        1,
        f"NOT_SERVING\nbad FAILED: {bad_model.error}\n",
    )
    assert bad_model.error.startswith("INVALID_CHECKPOINT: model.safetensors: header is not")
    assert (alive.returncode, alive.stdout) == (0, "SERVING\n")
    assert get_model(daemon.socket, "single").state == pb.MODEL_STATE_READY


def test_only_the_required_models_count(
    daemons: DaemonPool, checkpoints: Checkpoints, tmp_path: Path
) -> None:
    bad = write_malformed(tmp_path / "bad", "invalid-json")
    daemon = daemons.start(
        [checkpoints.single, bad],
        args=["--health-listen", "127.0.0.1:0", "--require", str(checkpoints.single)],
    )

    assert statuses(daemon.bound_port("health"))["readiness"] == "SERVING"


def test_readiness_flips_when_a_required_model_is_evicted(
    daemons: DaemonPool, checkpoints: Checkpoints
) -> None:
    daemon = daemons.start([checkpoints.single], args=["--health-listen", "127.0.0.1:0"])
    port = daemon.bound_port("health")
    wait_until(lambda: statuses(port)["readiness"] == "SERVING", timeout=30)

    with service_stub(daemon.socket) as stub:
        stub.Evict(pb.EvictRequest(name="single"), timeout=10)
    wait_until(lambda: statuses(port)["readiness"] == "NOT_SERVING", timeout=30)

    assert statuses(port) == {
        "": "NOT_SERVING",
        "readiness": "NOT_SERVING",
        "liveness": "SERVING",
        SERVICE_NAME: "SERVING",
    }


def test_require_names_a_start_up_model(checkpoints: Checkpoints, tmp_path: Path) -> None:
    result = run_cli("preload", str(checkpoints.single), "--require", str(tmp_path))

    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (
        f"weightcache preload: --require {str(tmp_path)!r}: not among the models to preload\n"
    )


def test_metrics_after_acquires(
    daemons: DaemonPool, workers: WorkerPool, checkpoints: Checkpoints, tmp_path: Path
) -> None:
    daemon = daemons.start(
        [checkpoints.single],
        args=["--metrics-listen", "127.0.0.1:0", "--max-memory", "1GiB"],
    )
    port = daemon.bound_port("metrics")
    worker = workers.start()
    assert_attached(worker.load(checkpoints.single, socket=daemon.socket, key="hit"))
    with service_stub(daemon.socket) as stub, pytest.raises(grpc.RpcError) as refused:
        stub.Acquire(pb.AcquireRequest(), timeout=10)  # names no model
    reason = rpc_failure(refused.value).reason
    size = get_model(daemon.socket, "single").size_bytes

    samples = scrape(port)

    assert {k: v for k, v in samples.items() if k[0] == "weightcache_models"} == {
        ("weightcache_models", (("state", "loading"),)): 0.0,
        ("weightcache_models", (("state", "ready"),)): 1.0,
        ("weightcache_models", (("state", "failed"),)): 0.0,
        ("weightcache_models", (("state", "evicting"),)): 0.0,
    }
    assert samples["weightcache_memory_held_bytes", ()] == size
    assert samples["weightcache_memory_budget_bytes", ()] == 2**30
    assert samples["weightcache_leases_active", ()] == 1
    assert {k: v for k, v in samples.items() if k[0] == "weightcache_acquires_total"} == {
        ("weightcache_acquires_total", (("reason", ""), ("result", "granted"))): 1.0,
        ("weightcache_acquires_total", (("reason", reason), ("result", "refused"))): 1.0,
    }
    assert samples["weightcache_acquire_duration_seconds_count", ()] == 2
    assert samples["weightcache_acquire_duration_seconds_bucket", (("le", "+Inf"),)] == 2
    assert samples["weightcache_preloads_total", (("reason", ""), ("result", "ready"))] == 1
    assert samples["weightcache_preload_bytes_total", ()] == size
    assert samples["weightcache_preload_seconds_total", ()] > 0
    assert samples["weightcache_lease_expiries_total", ()] == 0
    assert samples["weightcache_lease_revocations_total", ()] == 0
    assert (
        samples[
            "weightcache_daemon_info",
            (("backend", "cpu_shm"), ("device_uuid", ""), ("version", __version__)),
        ]
        == 1
    )

    # A forced evict revokes the live lease: counted.
    with service_stub(daemon.socket) as stub:
        stub.Evict(pb.EvictRequest(name="single", force=True), timeout=10)
    assert scrape(port)["weightcache_lease_revocations_total", ()] == 1


@pytest.mark.parametrize("flag", ["--health-listen", "--metrics-listen"])
def test_a_busy_or_malformed_listen_address_stops_the_start(daemons: DaemonPool, flag: str) -> None:
    with socketlib.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        socket = daemons.socket("busy")
        taken = run_cli("preload", "--socket", socket, flag, f"127.0.0.1:{port}")
    malformed = run_cli("preload", "--socket", socket, flag, "nowhere")
    too_high = run_cli("preload", "--socket", socket, flag, "127.0.0.1:70000")

    assert (taken.returncode, taken.stdout) == (1, "")
    assert f"weightcache preload: {flag} 127.0.0.1:{port}: cannot bind: " in taken.stderr
    assert (malformed.returncode, malformed.stdout) == (1, "")
    assert malformed.stderr.endswith(f"weightcache preload: {flag} 'nowhere': use HOST:PORT\n")
    assert (too_high.returncode, too_high.stdout) == (1, "")
    assert too_high.stderr.endswith(
        f"weightcache preload: {flag} '127.0.0.1:70000': the port is above 65535\n"
    )
    assert not os.path.exists(socket)
    assert not os.path.exists(socket + ".lock")


def test_a_draining_daemon_is_alive_but_not_ready(
    daemons: DaemonPool, workers: WorkerPool, checkpoints: Checkpoints
) -> None:
    daemon = daemons.start(
        [checkpoints.single],
        args=["--health-listen", "127.0.0.1:0", "--drain-timeout", "60"],
    )
    port = daemon.bound_port("health")
    worker = workers.start()
    # on_revoke="raise": the worker keeps its lease (no copy and release) at REVOKING, so
    # the drain stays open until it closes.
    reply = worker.load(checkpoints.single, socket=daemon.socket, on_revoke="raise")
    assert_attached(reply)
    wait_until(lambda: statuses(port)["readiness"] == "SERVING", timeout=30)

    daemon.proc.send_signal(signal.SIGTERM)
    wait_until(lambda: statuses(port)["readiness"] == "NOT_SERVING", timeout=30)

    assert statuses(port) == {
        "": "NOT_SERVING",
        "readiness": "NOT_SERVING",
        "liveness": "SERVING",
        SERVICE_NAME: "NOT_SERVING",
    }
    assert worker.request("close", key="w")["ok"]
    assert daemon.proc.wait(30) == 0


def test_readiness_returns_once_failed_start_up_models_are_fixed_or_evicted(
    daemons: DaemonPool, checkpoints: Checkpoints, tmp_path: Path
) -> None:
    # Before (issue 37, item 16): readiness stayed NOT_SERVING after the failed start-up
    # models were loaded again or evicted, with no reason printed; only a restart cleared it.
    bad = write_malformed(tmp_path / "bad", "invalid-json")
    gone = write_malformed(tmp_path / "gone", "invalid-json")
    daemon = daemons.start(
        [checkpoints.single, bad, gone],
        args=["--allow-remote-preload", "--model-root", str(tmp_path)],
    )

    def ready() -> tuple[int, str]:
        result = run_cli("health", "--socket", daemon.socket)
        return result.returncode, result.stdout

    assert ready()[0] == 1
    shutil.rmtree(bad)
    shutil.copytree(checkpoints.other, bad)  # fixed
    loaded = run_cli("load", str(bad), "--socket", daemon.socket)
    assert (loaded.returncode, loaded.stdout.split()[:2]) == (0, ["bad", "READY"]), loaded
    gone_error = get_model(daemon.socket, "gone").error
    assert ready() == (1, f"NOT_SERVING\ngone FAILED: {gone_error}\n")

    evicted = run_cli("evict", "gone", "--socket", daemon.socket)
    assert evicted.returncode == 0, evicted.stderr
    wait_until(lambda: ready() == (0, "SERVING\n"), timeout=30)

    # A required model that was READY and is evicted keeps readiness off, and says why.
    assert run_cli("evict", "single", "--socket", daemon.socket).returncode == 0
    wait_until(lambda: ready()[0] == 1, timeout=30)
    assert ready() == (1, f"NOT_SERVING\n{NO_MODEL_TO_BLAME}\n")

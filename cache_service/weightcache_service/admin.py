"""The client subcommands of the ``weightcache`` command: ``health``, ``ls``, ``info``,
``leases``, ``load`` and ``evict`` against a running daemon.

Kept apart from :mod:`weightcache_service.cli` (the parser and ``preload``) so that the
parser starts without gRPC, protobuf or structlog (``weightcache --version``), and these
commands import gRPC and the generated messages only: never torch, nor the daemon's
modules (``weightcache health`` is an exec probe). A refusal is decoded by
:mod:`weightcache.core.status`, torch-free. ``bench/admin_commands.py`` measures them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import grpc

from weightcache.core.rpc import LIVENESS, READINESS, call, connect, target
from weightcache.core.sockets import no_socket
from weightcache.v1 import weight_cache_service_pb2 as pb

if TYPE_CHECKING:
    from google.protobuf.message import Message

EXIT_FAILURE = 1


def health(socket: str, liveness: bool, timeout: float) -> int:
    """``weightcache health``: print the readiness (or liveness) status; exit 0 when
    SERVING. NOT_SERVING readiness is followed by the models that are not READY."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    service = LIVENESS if liveness else READINESS
    if not os.path.exists(socket):
        print(f"weightcache health: {no_socket(socket)}", file=sys.stderr)
        return EXIT_FAILURE
    try:
        with grpc.insecure_channel(target(socket)) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    except grpc.RpcError as exc:
        print(f"weightcache health: not serving: {exc.code().name}", file=sys.stderr)
        return EXIT_FAILURE
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(name)
    if reply.status == health_pb2.HealthCheckResponse.SERVING:
        return 0
    if service == READINESS:
        for line in _not_ready_models(socket, timeout):
            print(line)
    return EXIT_FAILURE


def _not_ready_models(socket: str, timeout: float) -> list[str]:
    """Why readiness is NOT_SERVING, one line per model that is not READY (its state,
    progress and error), or none when the daemon does not say (it is draining, or the
    listing is refused)."""
    try:
        channel, stub = connect(socket)
        with channel:
            reply = stub.ListModels(pb.ListModelsRequest(), timeout=timeout)
    except grpc.RpcError:
        return []
    lines = []
    for m in reply.models:
        if m.state == pb.MODEL_STATE_READY:
            continue
        state = pb.ModelState.Name(m.state).removeprefix("MODEL_STATE_")
        done = progress(m)
        why = f": {m.error}" if m.error else f" {done}" if done != "-" else ""
        lines.append(f"{m.name} {state}{why}")
    return lines


def _print_json(message: Message) -> None:
    from google.protobuf import json_format

    data = json_format.MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    print(json.dumps(data, indent=2, sort_keys=True))


def progress(model: pb.Model) -> str:
    """Load progress: a percentage of the bytes while LOADING, else ``-``."""
    total = model.progress.bytes_total
    if model.state != pb.MODEL_STATE_LOADING:
        return "-"
    return f"{100 * model.progress.bytes_done // total}%" if total else "0%"


def ls(socket: str, timeout: float, as_json: bool) -> int:
    channel, stub = connect(socket)
    with channel:
        reply = call(lambda: stub.ListModels(pb.ListModelsRequest(), timeout=timeout))
    if as_json:
        _print_json(reply)
        return 0
    rows = [("NAME", "STATE", "PROGRESS", "BYTES", "TENSORS", "LEASES", "DTYPE", "FINGERPRINT")]
    for m in reply.models:
        state = pb.ModelState.Name(m.state).removeprefix("MODEL_STATE_")
        rows.append(
            (
                m.name,
                state,
                progress(m),
                str(m.size_bytes),
                str(m.tensor_count),
                str(m.lease_count),
                m.recipe.dtype or "-",
                m.fingerprint.digest[:16],
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    for m in reply.models:
        if m.error:  # a FAILED model: why, below the table
            print(f"{m.name}: {m.error}")
    return 0


def _table(rows: Sequence[Sequence[str]]) -> None:
    """Print ``rows`` (the first is the header) as left-aligned columns."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def leases(socket: str, model: str, timeout: float, as_json: bool) -> int:
    channel, stub = connect(socket)
    with channel:
        reply = call(lambda: stub.ListLeases(pb.ListLeasesRequest(model=model), timeout=timeout))
    if as_json:
        _print_json(reply)
        return 0
    now = time.time()
    rows = [
        (
            "LEASE",
            "MODEL",
            "STATE",
            "MODE",
            "AGE",
            "TTL",
            "UID",
            "PID",
            "WORKER PID",
            "HOST",
            "LABEL",
        )
    ]
    for h in reply.leases:
        peer = h.peer if h.HasField("peer") else None
        rows.append(
            (
                h.lease.lease_id[:8],
                h.lease.model,
                pb.LeaseState.Name(h.state).removeprefix("LEASE_STATE_"),
                h.worker.mode or "-",
                _seconds(now - h.create_time.ToMicroseconds() / 1e6),
                _seconds(h.lease.ttl.ToMicroseconds() / 1e6),
                str(peer.uid) if peer else "?",
                (str(peer.pid) if peer.pid else "-") if peer else "?",
                str(h.worker.pid),
                h.worker.hostname or "-",
                h.worker.label or "-",
            )
        )
    _table(rows)
    return 0


def _seconds(value: float) -> str:
    """A duration in seconds for a table: ``4.2s``, ``95s``, ``12m``, ``3.1h``."""
    if value < 10:
        return f"{max(value, 0):.1f}s"
    if value < 600:
        return f"{value:.0f}s"
    return f"{value / 60:.0f}m" if value < 36000 else f"{value / 3600:.1f}h"


def info(socket: str, timeout: float, as_json: bool) -> int:
    channel, stub = connect(socket)
    with channel:
        reply = call(lambda: stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=timeout))
    if as_json:
        _print_json(reply)
        return 0
    for key in (
        "version",
        "protocol_version",
        "torch_version",
        "backend",
        "device",
        "memory_held_bytes",
        "memory_budget_bytes",
        "instance_id",
    ):
        print(f"{key}: {getattr(reply, key)}")
    return 0


def load(socket: str, args: argparse.Namespace) -> int:
    import logging

    from rich.console import Console

    from weightcache_service.load_command import run_load

    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr)
    console = Console(stderr=True)
    last = run_load(
        socket, args.model, args.revision, dtype=args.dtype, timeout=args.timeout, console=console
    )
    state = pb.ModelState.Name(last.state).removeprefix("MODEL_STATE_")
    print(f"{last.model} {state} {last.progress.bytes_total} bytes")
    return 0 if last.state == pb.MODEL_STATE_READY else EXIT_FAILURE


def evict(socket: str, name: str, force: bool, timeout: float) -> int:
    channel, stub = connect(socket)
    with channel:
        call(lambda: stub.Evict(pb.EvictRequest(name=name, force=force), timeout=timeout))
    print(f"evicted {name}" if not force else f"evicting {name}")
    return 0

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
import os
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import grpc

from weightcache.core.errors import ModelNotFoundError
from weightcache.core.rpc import LIVENESS, READINESS, call, connect, target
from weightcache.core.sockets import no_socket
from weightcache.v1 import weight_cache_service_pb2 as pb

if TYPE_CHECKING:
    from google.protobuf.message import Message
    from rich.console import Console

EXIT_FAILURE = 1
#: Exit status after Ctrl-C (128 + SIGINT, as shells report it).
EXIT_INTERRUPTED = 130


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
        lines = _not_ready_models(socket, timeout)
        for line in lines or [NO_MODEL_TO_BLAME]:
            print(line)
    return EXIT_FAILURE


#: What ``health`` prints when readiness is NOT_SERVING and no model is to blame.
NO_MODEL_TO_BLAME = (
    "no model is LOADING or FAILED: the daemon is starting, draining or stopping, or a "
    "required model was evicted (load it again)"
)


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
    """``message`` in the protobuf JSON mapping, except that 64-bit integers stay numbers
    (the mapping writes them as strings, which a shell's ``jq`` would compare as text)."""
    import json

    from google.protobuf import json_format

    data = json_format.MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    print(json.dumps(_int64_as_numbers(message, data), indent=2, sort_keys=True))


_INT64_TYPES = frozenset({3, 4, 16, 18, 6})  # FieldDescriptor.TYPE_(U)INT64, (S)FIXED64, SINT64


def _int64_as_numbers(message: Message, data: Any) -> Any:
    """``data`` (``message`` as ``MessageToDict`` wrote it) with each 64-bit integer field
    an int again; well-known types (Duration, Timestamp) keep their strings."""
    if not isinstance(data, dict) or message.DESCRIPTOR.full_name.startswith("google."):
        return data
    for field in message.DESCRIPTOR.fields:
        if field.name not in data:
            continue
        value = getattr(message, field.name)
        repeated = field.is_repeated
        if field.type in _INT64_TYPES:
            data[field.name] = [int(v) for v in data[field.name]] if repeated else int(value)
        elif field.message_type is not None and not field.message_type.GetOptions().map_entry:
            if repeated:
                data[field.name] = [
                    _int64_as_numbers(m, d) for m, d in zip(value, data[field.name], strict=True)
                ]
            else:
                data[field.name] = _int64_as_numbers(value, data[field.name])
    return data


def human_bytes(count: int) -> str:
    """``count`` bytes in binary units, one decimal, no blank (one table cell): ``512B``,
    ``1.5KiB``, ``40.0MiB``, ``7.3GiB`` (IEC 80000-13 prefixes)."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{count}B" if unit == "B" else f"{value:.1f}{unit}"


def progress(model: pb.Model) -> str:
    """Load progress: a percentage of the bytes while LOADING, ``hashing`` once every byte
    is copied and the fingerprint is still pending (level ``full``: the shards' sha256),
    else ``-``."""
    total = model.progress.bytes_total
    if model.state != pb.MODEL_STATE_LOADING:
        return "-"
    done = model.progress.bytes_done
    if total and done >= total and not model.fingerprint.digest:
        return "hashing"
    return f"{100 * done // total}%" if total else "0%"


def ls(socket: str, timeout: float, as_json: bool) -> int:
    channel, stub = connect(socket)
    with channel:
        reply = call(lambda: stub.ListModels(pb.ListModelsRequest(), timeout=timeout))
    if as_json:
        _print_json(reply)
        return 0
    # SOURCE last: "peer HOST:PORT" holds a space.
    rows = [
        (
            "NAME",
            "STATE",
            "PROGRESS",
            "SIZE",
            "TENSORS",
            "LEASES",
            "DTYPE",
            "FINGERPRINT",
            "SOURCE",
        )
    ]
    for m in reply.models:
        state = pb.ModelState.Name(m.state).removeprefix("MODEL_STATE_")
        rows.append(
            (
                m.name,
                state,
                progress(m),
                human_bytes(m.size_bytes),
                str(m.tensor_count),
                str(m.lease_count),
                m.recipe.dtype or "-",
                m.fingerprint.digest[:16],
                m.source or "checkpoint",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    for m in reply.models:
        if m.error:  # a FAILED model: why, below the table
            print(f"{m.name}: {m.error}")
    for u in reply.unlinked:
        # Revoked on shared memory: not held, not free until these workers unmap it.
        print(
            f"{u.model}: unlinked, {human_bytes(u.size_bytes)} still mapped by "
            f"{u.lease_count} revoked lease(s)"
        )
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
    for key in ("version", "protocol_version", "torch_version", "backend", "device"):
        print(f"{key}: {getattr(reply, key)}")
    print(f"memory_held_bytes: {reply.memory_held_bytes} ({human_bytes(reply.memory_held_bytes)})")
    unlinked = reply.memory_unlinked_bytes
    print(f"memory_unlinked_bytes: {unlinked} ({human_bytes(unlinked)})")
    budget = reply.memory_budget_bytes
    # 0 on the wire: no budget beyond what the backend has (GetServerInfoResponse).
    shown = f"{budget} ({human_bytes(budget)})" if budget else "unlimited"
    print(f"memory_budget_bytes: {shown}")
    print(f"instance_id: {reply.instance_id}")
    return 0


def load(socket: str, args: argparse.Namespace) -> int:
    """``weightcache load``: Preload with a progress bar; exit 0 once READY, also when the
    daemon already holds the model READY (idempotent). Ctrl-C stops following, not the
    load: the daemon goes on loading, and this says so (exit 130)."""
    import logging

    from rich.console import Console

    from weightcache.core.errors import ModelExistsError
    from weightcache_service.load_command import run_load

    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr)
    console = Console(stderr=True)
    _exit_on_interrupt(console)
    plugins = _recipe_plugins(args.recipe)
    try:
        last = run_load(
            socket,
            args.model,
            args.revision,
            dtype=args.dtype,
            timeout=args.timeout,
            console=console,
            seed_from=args.seed_from or "",
            plugins=plugins,
        )
    except ModelExistsError as err:
        return _already_held(socket, err.metadata.get("model", ""), args.timeout, err)
    state = pb.ModelState.Name(last.state).removeprefix("MODEL_STATE_")
    print(f"{last.model} {state} {last.progress.bytes_total} bytes")
    return 0 if last.state == pb.MODEL_STATE_READY else EXIT_FAILURE


#: What ``weightcache load`` says on Ctrl-C, last on stderr.
INTERRUPTED = (
    "weightcache load: interrupted; the daemon goes on loading the model (`weightcache ls` "
    "shows its progress, `weightcache evict NAME` drops it once loaded)"
)


def _exit_on_interrupt(console: Console) -> None:
    """On SIGINT: the cursor shown again, :data:`INTERRUPTED` printed, exit
    :data:`EXIT_INTERRUPTED` at once (``os._exit``). The load is the daemon's and goes on;
    here there is nothing to clean up. A KeyboardInterrupt raised inside gRPC's streaming
    call could leave one of its locks held, and the channel's close at exit then hung
    (issue 35: 1 run in 2 beside another suite, the command still there after 60 s)."""
    import signal

    def interrupted(signum: int, frame: object) -> None:
        console.show_cursor(True)
        print(INTERRUPTED, file=sys.stderr, flush=True)
        os._exit(EXIT_INTERRUPTED)

    signal.signal(signal.SIGINT, interrupted)


def _recipe_plugins(steps: list[str]) -> list[pb.RecipePlugin]:
    """``--recipe NAME[:k=v,...]`` steps as the Preload's recipe plugins, in order.

    Raises:
        RecipeError: a step is malformed (``PluginStep.parse``).
    """
    if not steps:
        return []
    # Only with --recipe: core.plugins imports torch (through core.pipeline).
    from weightcache.core.plugins import PluginStep

    parsed = [PluginStep.parse(text) for text in steps]
    return [pb.RecipePlugin(name=step.name, params=dict(step.params)) for step in parsed]


def _already_held(socket: str, name: str, timeout: float | None, err: Exception) -> int:
    """A Preload of a model the daemon holds: success when it is READY (printed as a load
    that completed, with ``(already held)``), else the refusal."""
    channel, stub = connect(socket)
    with channel:
        model = call(lambda: stub.GetModel(pb.GetModelRequest(name=name), timeout=timeout)).model
    if model.state != pb.MODEL_STATE_READY:
        raise err
    print(f"{model.name} READY {model.progress.bytes_total} bytes (already held)")
    return 0


def evict(socket: str, name: str, force: bool, timeout: float) -> int:
    """``weightcache evict NAME|PATH``: a name as ``ls`` shows it, or the path of a
    checkpoint folder whose one model is evicted (issue 37, item 18: a path was
    MODEL_NOT_FOUND, as if nothing were loaded from it).

    Raises:
        WeightCacheError: the daemon refused (``MODEL_NOT_FOUND`` naming what a path
            matched, ``LEASES_ACTIVE``, ...).
    """
    channel, stub = connect(socket)
    with channel:
        models = call(lambda: stub.ListModels(pb.ListModelsRequest(), timeout=timeout)).models
        name = _model_named(name, models)
        call(lambda: stub.Evict(pb.EvictRequest(name=name, force=force), timeout=timeout))
    print(f"evicted {name}" if not force else f"evicting {name}")
    return 0


def _model_named(text: str, models: Sequence[pb.Model]) -> str:
    """The name of the model ``text`` designates: itself when a model has that name, else
    the one model loaded from the path ``text`` (compared as real paths).

    Raises:
        ModelNotFoundError: ``text`` is a path from which no model, or several, are loaded.
    """
    if any(m.name == text for m in models) or not os.path.exists(text):
        return text
    real = os.path.realpath(text)
    names = [m.name for m in models if os.path.realpath(m.path) == real]
    if len(names) == 1:
        return names[0]
    if not names:
        raise ModelNotFoundError(f"no model is loaded from {text} (weightcache ls lists them)")
    raise ModelNotFoundError(
        f"{len(names)} models are loaded from {text}: {', '.join(names)}; evict one by name"
    )

"""The ``weightcache`` command.

Subcommands:

- ``preload MODEL_DIR... [--socket PATH] [--dtype D]``: run the daemon in the foreground,
  loading each checkpoint at start. A MODEL_DIR that does not exist may be a Hub repo id
  (``org/name`` or ``org/name@REVISION``) in the local Hub cache
  (:mod:`weightcache.core.hub`). Stops
  cleanly on SIGTERM or SIGINT. ``--require``, ``--health-listen`` and
  ``--metrics-listen``: see :mod:`weightcache_service.health` and :mod:`.metrics`.
- ``ls [--json]``: the models held, their state, load progress, bytes and leases; below,
  why each FAILED one failed. ``--json``: the ListModels reply in the protobuf JSON mapping.
- ``load PATH|REPO_ID [--revision R] [--dtype D] [--seed-from PEER]``: ask the running
  daemon to preload a checkpoint (Preload RPC; the daemon needs ``--allow-remote-preload``;
  seeded from the peer daemon PEER, or several comma-separated, first, docs/seeding.md),
  with a progress bar on stderr; exits 0 once READY (:mod:`weightcache_service.load_command`).
- ``health [--readiness|--liveness]``: exit 0 only when the daemon is ready (every
  required model READY), or with ``--liveness`` when its event loop answers (exec probes).
- ``info [--json]``: versions, backend and memory of the daemon.
- ``leases [MODEL] [--json]``: the live leases, who holds each (the uid and pid the kernel
  gives the daemon for the holder's connection, the worker's own pid, host name and
  label), mode, age and TTL (ListLeases).
- ``evict NAME [--force]``: drop a model.
- ``gc [--dry-run]``: remove the /dev/shm segments of daemons that died without cleaning
  up (a SIGKILL, a crash), whatever socket they served; prints one line per segment.
  Only the caller's own segments, or any for root; a live daemon's are never touched.
  Entries named like segments that are not regular files the caller may remove (a
  folder, a symlink, another user's file: anyone can create names in /dev/shm) are
  skipped with a ``skipped PATH: WHY`` line. Exits 0, or 1 when /dev/shm cannot be read.

The daemon and every client subcommand take ``--device`` (default ``cpu``) and
``--socket``: without ``--socket``, the socket is the device's by the one rule of
:mod:`weightcache.core.sockets` (``$WEIGHTCACHE_SOCKET``, else ``cpu.sock`` or
``GPU-<uuid>.sock`` in the runtime dir), the same rule a worker's
``weightcache.load(path, device=...)`` follows. A client subcommand exits 1 with the
daemon's reason when a request fails (``DEVICE_NOT_VISIBLE`` when ``--device`` is a GPU
whose UUID cannot be read), 2 when ``--device`` names no device.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from weightcache.core.errors import RecipeError, WeightCacheError
from weightcache.core.levels import DEFAULT_LEVEL, LEVELS
from weightcache.core.sockets import default_socket

# Only the parser is imported with the command: the client subcommands' gRPC in
# weightcache_service.admin, structlog and the daemon's modules (and torch) inside
# `preload`, so that `--version` and `health` (an exec probe) start at once
# (bench/admin_commands.py).
if TYPE_CHECKING:
    from weightcache_service.backend import Device
    from weightcache_service.server import TcpListener

EXIT_FAILURE = 1
EXIT_USAGE = 2
DEVICE_HELP = (
    "cpu, cuda:N, N or a GPU UUID: the daemon's device, whose socket is the default (default: cpu)"
)


LOG_LEVELS = ("debug", "info", "warning", "error")


def import_structlog_without_rich() -> None:
    """Import structlog, if nothing has yet, without letting it import rich.

    ``structlog.dev`` and ``structlog.tracebacks`` import rich at their import whenever it
    is installed (it is: ``weightcache load`` draws its progress with it), only to render
    exceptions prettily: on this project's VMs that was 0.4 to 0.6 s of the daemon's start
    and several MiB of its memory (issue 39, ``python -X importtime``). Hidden from that one
    import (``sys.modules["rich"] = None`` makes ``import rich`` raise ImportError, the
    import system's documented way to block a module), structlog falls back to its plain
    ``traceback`` rendering; rich stays importable afterwards for whoever needs it.
    """
    if "structlog" in sys.modules or "rich" in sys.modules:
        return
    sys.modules["rich"] = None  # type: ignore[assignment]
    try:
        import structlog  # noqa: F401
    finally:
        del sys.modules["rich"]


def configure_logging(fmt: str = "console", level: str = "info") -> None:
    """Send structlog output at ``level`` and above to stderr as console lines or JSON, and
    standard logging's (the SDK's, libraries') through the same level and renderer, so that
    a ``json`` log holds JSON lines only (structlog's ``ProcessorFormatter``)."""
    import logging

    import_structlog_without_rich()
    import structlog

    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    stamped: list[structlog.typing.Processor] = [
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[structlog.stdlib.add_logger_name, *stamped],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    structlog.configure(
        processors=[*stamped, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


class _Version(argparse.Action):
    """``--version``, reading the package's version only when asked (importlib.metadata
    scans the installed distributions)."""

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        from weightcache.core.version import __version__

        print(f"weightcache {__version__}")
        parser.exit()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="weightcache",
        description="Serve preloaded model weights to workers (preload), and look after the "
        "daemon (health, ls, info, evict, gc).",
    )
    parser.add_argument("--version", action=_Version, nargs=0, help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True)

    daemon = sub.add_parser("preload", help="run the daemon, preloading checkpoints")
    daemon.add_argument("models", nargs="*", metavar="MODEL_DIR")
    daemon.add_argument("--socket", default=None, help="Unix socket (default: per device)")
    daemon.add_argument(
        "--device",
        default="cpu",
        help="cpu (shared memory), or cuda:N, N / a GPU UUID (CUDA IPC, one daemon per GPU)",
    )
    daemon.add_argument("--dtype", default=None, help="cast floating tensors: BF16, F16, F32, F64")
    daemon.add_argument("--tp-size", type=int, default=1, help="tensor-parallel world size")
    daemon.add_argument(
        "--tp-rank",
        action="append",
        default=[],
        metavar="RANKS",
        help="rank(s) to hold: N, A-B, or 'all'; repeatable (default: all ranks)",
    )
    daemon.add_argument("--tp-plan", default=None, metavar="FILE", help="JSON {pattern: style}")
    daemon.add_argument(
        "--recipe",
        action="append",
        default=[],
        metavar="NAME[:k=v,...]",
        help="plugin step (entry point group weightcache.recipes); repeatable, in order",
    )
    daemon.add_argument(
        "--allow-recipe",
        action="append",
        default=[],
        metavar="NAME",
        help="plugin a remote Preload may use; repeatable",
    )
    daemon.add_argument(
        "--fingerprint-level",
        choices=LEVELS,
        default=DEFAULT_LEVEL,
        help="how much content the identity covers: full (sha256 of every byte), sampled, "
        f"layout; workers must load at the same level (default {DEFAULT_LEVEL})",
    )
    daemon.add_argument("--allow-remote-preload", action="store_true", help="accept Preload RPCs")
    daemon.add_argument(
        "--model-root", action="append", default=[], help="folder remote Preload may read"
    )
    daemon.add_argument(
        "--drain-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="how long lease holders get after REVOKING (SIGTERM, evict --force); default 30",
    )
    daemon.add_argument(
        "--hand-over",
        action="store_true",
        help="at SIGTERM, leave the arenas and leases to the next daemon on the socket "
        "(as SIGUSR2 always does) instead of draining",
    )
    daemon.add_argument(
        "--max-memory", default=None, help="arena budget: bytes (8GiB, 500M) or percent (80%%)"
    )
    daemon.add_argument(
        "--headroom", default=None, help="bytes a preload must leave available (default 256MiB)"
    )
    daemon.add_argument(
        "--log-format",
        choices=("console", "json"),
        default="console",
        help="log lines on stderr: console (aligned text) or json (one object a line)",
    )
    daemon.add_argument(
        "--log-level", choices=LOG_LEVELS, default="info", help="lowest level logged"
    )
    daemon.add_argument(
        "--group", default=None, help="group allowed to connect (folder 0750, socket 0660)"
    )
    daemon.add_argument("--listen", default=None, metavar="HOST:PORT", help="also serve TCP")
    daemon.add_argument(
        "--tls-cert", default=None, metavar="PEM", help="server certificate for --listen"
    )
    daemon.add_argument(
        "--tls-key", default=None, metavar="PEM", help="its private key, for --listen"
    )
    daemon.add_argument("--tls-client-ca", default=None, metavar="PEM", help="mutual TLS")
    daemon.add_argument(
        "--tls-client-subject",
        action="append",
        default=[],
        metavar="NAME",
        help="client certificate name (CN, SAN or CN=... subject) allowed; repeatable",
    )
    daemon.add_argument(
        "--allow-unauthenticated-info",
        action="store_true",
        help="TCP peers without an allowed client certificate may list models and info",
    )
    daemon.add_argument(
        "--insecure", action="store_true", help="plaintext TCP, loopback addresses only"
    )
    daemon.add_argument(
        "--allow-seeding",
        action="store_true",
        help="let authenticated peers (mutual TLS) seed READY models from this daemon",
    )
    daemon.add_argument(
        "--seed-from",
        default=None,
        metavar="HOST:PORT[,HOST:PORT...]",
        help="fill the start-up models from these peer daemons at once, verified; "
        "else load from files",
    )
    daemon.add_argument("--peer-tls-cert", default=None, metavar="PEM", help="seeding: our cert")
    daemon.add_argument("--peer-tls-key", default=None, metavar="PEM", help="seeding: our key")
    daemon.add_argument(
        "--peer-tls-ca", default=None, metavar="PEM", help="seeding: CA of the peers' certificates"
    )
    daemon.add_argument(
        "--seed-streams", type=int, default=4, help="parallel streams of a seed (default 4)"
    )
    daemon.add_argument(
        "--seed-chunk-bytes",
        type=int,
        default=4 << 20,
        help="bytes per message of a seed (default and most 4 MiB, at least 64 KiB)",
    )
    daemon.add_argument(
        "--seed-stall-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="abandon a seed for the files when a stream receives no whole chunk within "
        "this (default 30)",
    )
    daemon.add_argument(
        "--seed-max-rate",
        type=float,
        default=0.0,
        metavar="BYTES",
        help="bytes per second each stream served to a seeding peer may carry (0: no limit)",
    )
    daemon.add_argument(
        "--seed-plane",
        choices=("tcp", "grpc", "mooncake"),
        default="tcp",
        help="seed bytes over the sendfile data plane (tcp: plaintext, authorized per "
        "connection; default) or only inside TLS over gRPC (grpc), serving and seeding; "
        "mooncake: seed through Mooncake's transfer engine from peers with --seed-mooncake",
    )
    daemon.add_argument(
        "--seed-mooncake",
        action="store_true",
        help="offer seeding peers Mooncake's transfer engine on the data plane, through a "
        "staging ring (the `mooncake` extra; docs/seeding.md)",
    )
    daemon.add_argument(
        "--seed-data-port",
        type=int,
        default=0,
        metavar="PORT",
        help="port of the sendfile data plane on --listen's host (default 0: any free one)",
    )
    daemon.add_argument(
        "--health-listen",
        default=None,
        metavar="HOST:PORT",
        help="plaintext listener serving grpc.health.v1 only (Kubernetes grpc: probes)",
    )
    daemon.add_argument(
        "--metrics-listen",
        default=None,
        metavar="HOST:PORT",
        help="Prometheus metrics over HTTP (/metrics)",
    )
    daemon.add_argument(
        "--require",
        action="append",
        default=[],
        metavar="MODEL_DIR|none",
        help="start-up model that must be READY for readiness; repeatable "
        "(default: every MODEL_DIR; 'none': ready once start-up preloads ended)",
    )

    for name, text in (
        ("ls", "list models"),
        ("info", "daemon versions and memory"),
    ):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("--json", action="store_true", help="print the reply as JSON")
        _client_arguments(cmd)
    leases = sub.add_parser("leases", help="list live leases and who holds them")
    leases.add_argument("model", nargs="?", default="", help="only the leases on this model")
    leases.add_argument("--json", action="store_true", help="print the reply as JSON")
    _client_arguments(leases)
    load = sub.add_parser("load", help="ask the running daemon to preload a checkpoint")
    load.add_argument("model", metavar="PATH|REPO_ID")
    load.add_argument("--revision", default=None, help="Hub branch, tag or commit (default main)")
    load.add_argument("--dtype", default=None, help="cast floating tensors: BF16, F16, F32, F64")
    load.add_argument(
        "--seed-from",
        default=None,
        metavar="HOST:PORT[,HOST:PORT...]",
        help="have the daemon seed it from these peer daemons first (its --peer-tls-* files)",
    )
    load.add_argument(
        "--recipe",
        action="append",
        default=[],
        metavar="NAME[:k=v,...]",
        help="plugin step for the daemon to apply (one its --allow-recipe names); repeatable, "
        "in order",
    )
    load.add_argument(
        "--log-level", choices=LOG_LEVELS, default="warning", help="lowest level logged"
    )
    _client_arguments(load, timeout=None)
    health = sub.add_parser("health", help="exit 0 when ready (or, --liveness, alive)")
    probe = health.add_mutually_exclusive_group()
    probe.add_argument(
        "--readiness",
        dest="probe",
        action="store_const",
        const="readiness",
        help="every required model READY (the default)",
    )
    probe.add_argument(
        "--liveness",
        dest="probe",
        action="store_const",
        const="liveness",
        help="the daemon's event loop answers",
    )
    health.set_defaults(probe="readiness")
    _client_arguments(health)
    evict = sub.add_parser("evict", help="drop a model")
    evict.add_argument(
        "name", help="its name (as ls shows it), or the path it was loaded from, if only one"
    )
    evict.add_argument(
        "--force",
        action="store_true",
        help="revoke live leases (holders get REVOKING, then the model is dropped)",
    )
    _client_arguments(evict)
    gc = sub.add_parser(
        "gc",
        help="remove the shared-memory segments of dead daemons, and handed-over segments "
        "no successor took",
    )
    gc.add_argument("--dry-run", action="store_true", help="list them, remove nothing")
    gc.add_argument(
        "--handover-grace",
        type=float,
        default=None,
        metavar="SECONDS",
        help="a segment handed over (--hand-over, SIGUSR2) that no daemon adopted for this "
        "long is an orphan (default 600)",
    )
    return parser


def _client_arguments(cmd: argparse.ArgumentParser, timeout: float | None = 5.0) -> None:
    cmd.add_argument("--socket", default=None, help="the daemon's Unix socket (wins over --device)")
    cmd.add_argument("--device", default="cpu", help=DEVICE_HELP)
    cmd.add_argument(
        "--timeout",
        type=float,
        default=timeout,
        metavar="SECONDS",
        help=f"per RPC (default {timeout or 'none'})",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``weightcache`` command; returns the exit status.

    Without ``argv`` (the command line: the console script, ``python -m``), the process
    ends as soon as a client subcommand has its status (:func:`_exit_now`): the
    interpreter's teardown of grpc and protobuf was 14 to 16 ms of CPU of a 110 ms ``ls``
    (issue 39, bench/README.md). Called with ``argv``, it returns.
    """
    status = _command(argv)
    if argv is None:
        _exit_now(status)
    return status


def _command(argv: Sequence[str] | None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "preload":
        return _preload(args, argv)
    if args.command == "gc":
        return _gc(args.dry_run, args.handover_grace)
    try:
        socket = client_socket(args)
    except ValueError as err:
        print(f"weightcache {args.command}: {err}", file=sys.stderr)
        return EXIT_USAGE
    except WeightCacheError as err:
        print(f"weightcache {args.command}: {err.reason}: {err.detail}", file=sys.stderr)
        return EXIT_FAILURE
    from weightcache_service import admin

    if args.command == "health":
        return admin.health(socket, args.probe == "liveness", args.timeout)
    try:
        if args.command == "ls":
            return admin.ls(socket, args.timeout, args.json)
        if args.command == "info":
            return admin.info(socket, args.timeout, args.json)
        if args.command == "leases":
            return admin.leases(socket, args.model, args.timeout, args.json)
        if args.command == "load":
            return admin.load(socket, args)
        return admin.evict(socket, args.name, args.force, args.timeout)
    except WeightCacheError as err:
        print(f"weightcache {args.command}: {err.reason}: {err.detail}", file=sys.stderr)
        return EXIT_FAILURE


def client_socket(args: argparse.Namespace) -> str:
    """The socket of a client subcommand: ``--socket``, else ``--device``'s default.

    Raises:
        ValueError: ``--device`` names no device.
        DeviceNotVisibleError: ``--device`` is a GPU index whose UUID cannot be read.
    """
    return str(args.socket) if args.socket else default_socket(args.device)


def daemon_socket(args: argparse.Namespace, device: Device | None = None) -> str:
    """The daemon's socket: ``--socket``, else the default of its device (``device``, as
    resolved once by the caller; else ``--device``, resolved here), by the rule workers and
    the client subcommands follow. A GPU's socket is named by its UUID.

    Raises:
        DeviceError: ``--device`` names no visible device.
    """
    from weightcache_service.backend import resolve_device

    if device is None:
        device = resolve_device(args.device)
    return str(args.socket) if args.socket else default_socket(device.socket_device)


def _preload(args: argparse.Namespace, argv: Sequence[str] | None = None) -> int:
    import_structlog_without_rich()  # before signals, which imports structlog
    # Before anything imports prometheus_client, which reads the variable at import.
    from weightcache_service import signals

    signals.ignore_early()  # first: a SIGHUP while the rest imports must not end the daemon
    ignored = _drop_multiprocess_variables()
    import structlog

    from weightcache.core.plugins import PluginStep
    from weightcache.core.recipe import Placement, Recipe, parse_dtype
    from weightcache.core.tp import TPPlan
    from weightcache_service.access import Access, AccessError
    from weightcache_service.backend import DeviceError, resolve_device
    from weightcache_service.budget import MemoryBudget, parse_size
    from weightcache_service.options import ServiceOptions
    from weightcache_service.server import DaemonConfig, PreloadSpec, model_roots, run_daemon
    from weightcache_service.socket_lock import SocketInUseError, SocketLostError

    configure_logging(args.log_format, args.log_level)
    for name, value in ignored.items():
        structlog.get_logger("weightcache.daemon").warning(
            "ignored: the daemon's metrics are one process's", variable=name, value=value
        )
    level = args.fingerprint_level
    if args.drain_timeout is not None and args.drain_timeout < 0:
        print("weightcache preload: --drain-timeout must not be negative", file=sys.stderr)
        return EXIT_USAGE
    peer_tls = (args.peer_tls_cert, args.peer_tls_key, args.peer_tls_ca)
    if any(peer_tls) and not all(peer_tls):
        print(
            "weightcache preload: --peer-tls-cert, --peer-tls-key and --peer-tls-ca go together",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if args.seed_stall_timeout is not None and not args.seed_stall_timeout > 0:
        print("weightcache preload: --seed-stall-timeout must be positive", file=sys.stderr)
        return EXIT_USAGE
    if args.seed_from and not all(peer_tls):
        # Seeding RPCs need an authenticated peer: without a client certificate every seed
        # failed, late and obscurely (UNAVAILABLE, "Socket closed"; issue 37, item 17).
        print(
            "weightcache preload: --seed-from needs --peer-tls-cert, --peer-tls-key and "
            "--peer-tls-ca (peers seed only over mutual TLS; docs/seeding.md shows how to "
            "make the certificates)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if args.allow_seeding and args.listen is None:
        print("weightcache preload: --allow-seeding needs --listen", file=sys.stderr)
        return EXIT_USAGE
    if args.seed_mooncake or args.seed_plane == "mooncake":
        from weightcache_service.mooncake_plane import check_available

        if (why := check_available()) is not None:
            print(
                f"weightcache preload: --seed-plane mooncake/--seed-mooncake: {why}",
                file=sys.stderr,
            )
            return EXIT_USAGE
    if args.allow_remote_preload and not args.model_root:
        print(
            "weightcache preload: --allow-remote-preload needs at least one --model-root",
            file=sys.stderr,
        )
        return EXIT_USAGE
    try:
        max_bytes, percent = parse_size(args.max_memory) if args.max_memory else (None, None)
        headroom, headroom_percent = parse_size(args.headroom) if args.headroom else (None, None)
        if headroom_percent is not None:
            raise ValueError("--headroom takes bytes, not a percentage")
    except ValueError as err:
        print(f"weightcache preload: {err}", file=sys.stderr)
        return EXIT_USAGE
    try:
        recipe = Recipe(
            dtype=parse_dtype(args.dtype),
            tp_plan=TPPlan.from_json(args.tp_plan) if args.tp_plan else None,
            plugins=tuple(PluginStep.parse(text) for text in args.recipe),
        )
        ranks = parse_ranks(args.tp_rank, args.tp_size)
        named = _models(args.models)
        models = [path for path, _ in named]
        required = required_paths(
            models, [r if r == "none" else _models([r])[0][0] for r in args.require]
        )
        device = resolve_device(args.device)  # once: it names the socket and the backend
        config = DaemonConfig(
            socket=daemon_socket(args, device),
            device=device,
            preload=[
                PreloadSpec(
                    path,
                    recipe,
                    Placement(rank, args.tp_size),
                    level,
                    path in required,
                    name=name,
                    seed_from=args.seed_from or "",
                )
                for path, name in named
                for rank in ranks
            ],
            options=ServiceOptions(
                allow_remote_preload=args.allow_remote_preload,
                model_roots=model_roots(args.model_root),
                **({} if args.drain_timeout is None else {"drain_timeout": args.drain_timeout}),
                allowed_plugins=frozenset(args.allow_recipe),
                peer_tls=peer_tls if all(peer_tls) else None,
                seed_streams=max(1, args.seed_streams),
                seed_chunk_bytes=min(max(args.seed_chunk_bytes, 64 << 10), 4 << 20),
                **(
                    {}
                    if args.seed_stall_timeout is None
                    else {"seed_stall_timeout": args.seed_stall_timeout}
                ),
                seed_plane=args.seed_plane,
            ),
            allow_seeding=args.allow_seeding,
            seed_max_rate=args.seed_max_rate,
            seed_plane=args.seed_plane,
            seed_data_port=args.seed_data_port,
            seed_mooncake=args.seed_mooncake,
            budget=MemoryBudget(
                max_bytes=max_bytes,
                percent=percent,
                headroom=MemoryBudget.headroom if headroom is None else headroom,
            ),
            access=Access.for_group(args.group),
            tcp=_tcp(args),
            health_listen=args.health_listen,
            metrics_listen=args.metrics_listen,
            hand_over=args.hand_over,
            argv=list(sys.argv[1:] if argv is None else argv),
        )
        run_daemon(config)
    except (
        AccessError,
        DeviceError,
        SocketInUseError,
        SocketLostError,
        WeightCacheError,
        OSError,
    ) as err:
        print(f"weightcache preload: {err}", file=sys.stderr)
        return EXIT_USAGE if isinstance(err, WeightCacheError) else EXIT_FAILURE
    _exit_now(0)


def _exit_now(status: int) -> NoReturn:
    """End the daemon's process at once, after ``stopped`` (and a client subcommand's, once
    it printed everything: :func:`main`).

    Everything that must outlive the process is written by then: a hand-over's manifest
    (fsync'd and renamed, :func:`weightcache_service.handover.write_manifest`) and its
    renamed segments, or the freed arenas of a drain; the socket unlinked and its lock
    released; every load awaited (``Store.close``). What the interpreter's own exit would
    still do is tear down modules, gRPC's core and the objects of the heap, one by one:
    0.2 to 0.6 s on a 2-CPU VM (issue 39: measured from ``stopped`` to the exit), during
    which a hand-over's successor cannot take the socket. ``os._exit`` leaves that to the
    kernel (mappings, descriptors); the log streams are flushed first.
    """
    import logging

    logging.shutdown()  # flushes and closes the handlers (the stdlib side of the log)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BrokenPipeError:
            pass  # a reader gone (`| head`): what it wanted it had
        except (OSError, ValueError):
            # Output lost (a full disk, a closed stream): never exit 0 over it. 120 is
            # what CPython's own exit returns when flushing the standard streams fails.
            status = status or 120
    os._exit(status)


#: prometheus-client's multiprocess mode (its values in files of this folder), read when
#: prometheus_client is first imported.
MULTIPROC_VARIABLES = ("PROMETHEUS_MULTIPROC_DIR", "prometheus_multiproc_dir")


def _drop_multiprocess_variables() -> dict[str, str]:
    """Drop prometheus-client's multiprocess variables (returned, to be logged) before
    anything imports it: the daemon is one process with a registry of its own, and a
    variable set for another application would make its counters write files into that
    folder, or fail with a bare "No such file or directory" when the folder is missing."""
    return {name: os.environ.pop(name) for name in MULTIPROC_VARIABLES if name in os.environ}


def _models(texts: list[str]) -> list[tuple[str, str | None]]:
    """Model arguments as paths, in order, each with its model's name: Hub repo ids
    resolved in the local Hub cache (:mod:`weightcache.core.hub`), named after the repo id;
    a path named by its folder (None); what names nothing is kept (the daemon refuses it at
    start-up, logged, and serves the others)."""
    import structlog

    from weightcache.core.hub import resolve_or_keep

    paths = []
    for text in texts:
        path, name, why = resolve_or_keep(text)
        if why is not None:
            structlog.get_logger("weightcache.daemon").warning("not found", error=why)
        paths.append((path, name))
    return paths


def _tcp(args: argparse.Namespace) -> TcpListener | None:
    from weightcache_service.server import TcpListener

    if args.listen is None:
        return None
    return TcpListener(
        address=args.listen,
        cert=args.tls_cert,
        key=args.tls_key,
        client_ca=args.tls_client_ca,
        insecure=args.insecure,
        client_subjects=tuple(args.tls_client_subject),
        unauthenticated_info=args.allow_unauthenticated_info,
    )


def required_paths(models: list[str], require: list[str]) -> set[str]:
    """The start-up models (``models``, as given) that readiness waits for: every one when
    ``require`` is empty, none for ``["none"]``, else those ``require`` names (compared by
    realpath).

    Raises:
        RecipeError: a ``--require`` value is not among the start-up models.
    """
    if not require:
        return set(models)
    if require == ["none"]:
        return set()
    by_real = {os.path.realpath(m): m for m in models}
    chosen = set()
    for path in require:
        model = by_real.get(os.path.realpath(path))
        if model is None:
            raise RecipeError(f"--require {path!r}: not among the models to preload")
        chosen.add(model)
    return chosen


def parse_ranks(texts: list[str], size: int) -> list[int]:
    """Ranks from ``--tp-rank`` values (``3``, ``0-3``, ``all``); all ranks when none given.

    Raises:
        RecipeError: a value is malformed or outside ``[0, size)``.
    """
    if not texts:
        return list(range(size))
    ranks: set[int] = set()
    for text in texts:
        if text == "all":
            ranks.update(range(size))
            continue
        low, _, high = text.partition("-")
        try:
            first, last = int(low), int(high or low)
        except ValueError:
            raise RecipeError(f"--tp-rank {text!r}: use N, A-B or all") from None
        if not 0 <= first <= last < size:
            raise RecipeError(f"--tp-rank {text!r}: outside 0..{size - 1}")
        ranks.update(range(first, last + 1))
    return sorted(ranks)


def _gc(dry_run: bool, handover_grace: float | None) -> int:
    from weightcache.core.sockets import SHM_DIR
    from weightcache_service.segments import (
        HANDOVER_GRACE,
        Skipped,
        dead_segments,
        orphaned_handovers,
        remove_handed_over,
        remove_segment,
    )

    grace = HANDOVER_GRACE if handover_grace is None else handover_grace
    skipped: list[Skipped] = []
    try:
        dead = dead_segments(skipped=skipped)
        orphans = orphaned_handovers(grace, skipped=skipped)
    except OSError as exc:
        print(f"weightcache gc: cannot list {SHM_DIR}: {exc.strerror}", file=sys.stderr)
        return EXIT_FAILURE
    if not dead and not orphans:
        print("no segment of a dead daemon: nothing to remove")
    removals: list[tuple[str, Callable[[], Skipped | None]]] = [
        (f"{s.path} ({s.size} bytes, daemon pid {s.pid})", functools.partial(remove_segment, s))
        for s in dead
    ]
    now = time.time()
    removals += [
        (
            f"{h.path} ({h.size} bytes, handed over {now - h.at:.0f} s ago, not adopted)",
            functools.partial(remove_handed_over, h),
        )
        for h in orphans
    ]
    for what, remove in removals:
        if dry_run:
            print(f"would remove {what}")
            continue
        refused = remove()
        if refused is not None:
            skipped.append(refused)
            continue
        print(f"removed {what}")
    # Names anyone can plant in /dev/shm: reported, never a failure (SECURITY.md).
    for entry in skipped:
        print(f"skipped {entry.path}: {entry.why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""torch only where a tensor is computed (issue 39): a daemon that serves plain checkpoints,
and every admin command, never imports torch; a cast does, in the daemon, and still gives
the bytes of the disk path.

A daemon's imports are seen from outside in ``/proc/<pid>/maps``: ``import torch`` maps
``libtorch*.so`` (torch's C++ libraries) into the process, and nothing unmaps them.

The same for the other modules a path does not use (issue 39, item 2: start in
milliseconds): a daemon's start and the admin commands leave out what only another path
needs (:data:`LAZY`), seen in ``sys.modules`` of a fresh process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

import weightcache
from tests.support import assert_attached
from weightcache.core.sockets import segment_tag
from weightcache.testing import Checkpoints, Daemon, DaemonPool, WorkerPool
from weightcache.testing.checkpoints import assert_bitwise_equal
from weightcache.testing.daemon import child_env, shm_segments

#: Runs ``weightcache_service.cli.main`` on each argv of the JSON list in argv[1], in one
#: process (so the union of what the commands import is checked), and prints each exit
#: status and whether torch was imported by the end. ``--help`` exits by SystemExit.
_ADMIN = """
import json, sys
from weightcache_service.cli import main
codes = []
for argv in json.loads(sys.argv[1]):
    try:
        codes.append(main(argv))
    except SystemExit as exc:
        codes.append(exc.code)
print(json.dumps({"codes": codes, "torch": "torch" in sys.modules}))
"""

#: Modules that a daemon serving plain checkpoints over its Unix socket and the admin
#: commands (but ``load``, with its progress bar, and ``ls --json``/``info --json``: protobuf's
#: JSON mapping) do not use, each imported only on the path that does (issue 39, item 2).
LAZY = (
    "torch",
    "rich",  # structlog's pretty tracebacks; `weightcache load`'s progress bar
    "grpc._channel",  # grpc's synchronous channels: the SDK's and the admin commands'
    "google.protobuf.json_format",  # the hand-over manifest; `--json`
    "google.protobuf.descriptor_pb2",  # grpcio-reflection
    "grpc_reflection.v1alpha.reflection",  # at the first reflection call
    "weightcache.core.cuda",  # a GPU's device UUIDs and CUDA IPC, through ctypes
    "weightcache_service.sendfile_serve",  # --allow-seeding's data plane
    "weightcache_service.metrics",  # --metrics-listen
    "prometheus_client",
)
#: What the admin commands do not import: :data:`LAZY` but grpc's synchronous channels
#: (theirs), and the daemon's own modules and its log.
ADMIN_LAZY = (
    *(name for name in LAZY if name != "grpc._channel"),
    "structlog",
    "weightcache_service.server",
    "weightcache_service.cache",
    "weightcache_service.store",
    "weightcache_service.handover",
)

#: As :data:`_ADMIN`, printing which of the module names in argv[2] were imported.
_ADMIN_MODULES = _ADMIN.replace(
    '"torch": "torch" in sys.modules',
    '"loaded": sorted(n for n in json.loads(sys.argv[2]) if n in sys.modules)',
)

#: Runs the daemon (``cli.main``, argv in argv[1] as JSON) in the main thread; a thread
#: waits for its ``READY=1`` on a ``$NOTIFY_SOCKET`` of its own (what systemd reads),
#: prints which of the module names in argv[2] are imported, then stops it by SIGTERM.
_DAEMON = """
import json, os, signal, socket, sys, threading
from weightcache_service.cli import main
notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
notify.bind(sys.argv[3])
os.environ["NOTIFY_SOCKET"] = sys.argv[3]
def watch():
    while b"READY=1" not in notify.recv(4096).split(b"\\n"):
        pass
    loaded = sorted(name for name in json.loads(sys.argv[2]) if name in sys.modules)
    print(json.dumps(loaded), flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
threading.Thread(target=watch, daemon=True).start()
main(json.loads(sys.argv[1]))
"""


def torch_mapped(pid: int) -> bool:
    """Whether process ``pid`` has mapped one of torch's ``libtorch*.so`` libraries."""
    with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and os.path.basename(fields[5].strip()).startswith("libtorch"):
                return True
    return False


def run_admin(*commands: list[str]) -> dict[str, object]:
    """Run the admin commands in one fresh process; ``{"codes": [...], "torch": bool}``."""
    result = subprocess.run(
        [sys.executable, "-c", _ADMIN, json.dumps(commands)],
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env(),
        check=True,
    )
    reply: dict[str, object] = json.loads(result.stdout.splitlines()[-1])
    return reply


def preload_args(checkpoints: Checkpoints) -> list[str]:
    """What lets ``weightcache load`` ask the daemon for the test checkpoints."""
    return ["--allow-remote-preload", "--model-root", str(checkpoints.single.parent)]


@pytest.fixture(scope="module")
def plain_daemon(module_daemons: DaemonPool, checkpoints: Checkpoints) -> Daemon:
    """A daemon started with no model."""
    return module_daemons.start(args=preload_args(checkpoints))


def test_a_daemon_started_with_no_model_maps_no_torch(plain_daemon: Daemon) -> None:
    assert torch_mapped(plain_daemon.pid) is False


def test_a_daemon_serving_a_plain_checkpoint_to_a_worker_maps_no_torch(
    plain_daemon: Daemon, workers: WorkerPool, checkpoints: Checkpoints, tmp_path: Path
) -> None:
    loaded = run_admin(["load", str(checkpoints.sharded), "--socket", plain_daemon.socket])
    worker = workers.start()

    reply = worker.load(checkpoints.sharded, socket=plain_daemon.socket, dump=tmp_path / "w")

    assert loaded == {"codes": [0], "torch": False}
    assert_attached(reply)
    assert_bitwise_equal(load_file(tmp_path / "w"), checkpoints.tensors)
    assert torch_mapped(worker.pid) is True  # the observation works: the worker has torch
    assert torch_mapped(plain_daemon.pid) is False


def test_no_admin_command_imports_torch(plain_daemon: Daemon, checkpoints: Checkpoints) -> None:
    socket = ["--socket", plain_daemon.socket]
    helps = [[command, "--help"] for command in ("ls", "info", "leases", "load", "health")]
    helps += [["evict", "--help"], ["gc", "--help"], ["preload", "--help"], ["--version"]]
    commands = [
        ["load", str(checkpoints.other), *socket],
        ["ls", *socket],
        ["ls", "--json", *socket],
        ["info", *socket],
        ["info", "--json", *socket],
        ["leases", *socket],
        ["health", *socket],
        ["health", "--liveness", *socket],
        ["evict", "no-such-model", *socket],  # refused: MODEL_NOT_FOUND decoded
        ["evict", "other", *socket],
        ["gc", "--dry-run"],
    ]

    reply = run_admin(*helps, *commands)

    assert reply == {"codes": [0] * len(helps) + [0] * 8 + [1, 0, 0], "torch": False}
    assert torch_mapped(plain_daemon.pid) is False


def test_a_cast_imports_torch_in_the_daemon_and_gives_the_disk_bytes(
    daemons: DaemonPool, workers: WorkerPool, checkpoints: Checkpoints, tmp_path: Path
) -> None:
    daemon = daemons.start(args=preload_args(checkpoints))
    before = torch_mapped(daemon.pid)
    loaded = run_admin(
        ["load", str(checkpoints.single), "--dtype", "F16", "--socket", daemon.socket]
    )

    reply = workers.start().load(
        checkpoints.single, socket=daemon.socket, dtype="F16", dump=tmp_path / "w"
    )

    assert (before, loaded) == (False, {"codes": [0], "torch": False})
    assert torch_mapped(daemon.pid) is True
    assert_attached(reply)
    disk = weightcache.load_from_disk(checkpoints.single, dtype="F16").tensors
    assert_bitwise_equal(load_file(tmp_path / "w"), disk)


def test_the_torch_free_sizes_are_torchs() -> None:
    """``ITEMSIZES`` plans headers and arenas without torch; it must name the dtypes of
    ``TORCH_DTYPES`` with their sizes."""
    from weightcache.core.dtypes import ITEMSIZES, SAFETENSORS_NAMES, TORCH_DTYPES

    assert {name: dtype.itemsize for name, dtype in TORCH_DTYPES.items()} == ITEMSIZES
    assert {v: k for k, v in SAFETENSORS_NAMES.items()} == TORCH_DTYPES


def test_the_daemons_torch_version_is_read_without_importing_torch() -> None:
    code = (
        "import sys\n"
        "from weightcache_service.environment import torch_version\n"
        "found = torch_version()\n"
        "imported = 'torch' in sys.modules\n"
        "import torch\n"
        "print(found == torch.__version__ != '', imported)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )

    assert result.stdout == "True False\n"


def imported_by_daemon(argv: list[str], notify: Path, names: tuple[str, ...]) -> list[str]:
    """Start a daemon (``weightcache ARGV``) in a fresh process; which of ``names`` it has
    imported once ready (``READY=1``). It is stopped (SIGTERM) and must exit 0.

    Raises:
        subprocess.CalledProcessError: it exited with another status.
    """
    result = subprocess.run(
        [sys.executable, "-c", _DAEMON, json.dumps(argv), json.dumps(names), str(notify)],
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env(),
        check=True,
    )
    loaded: list[str] = json.loads(result.stdout.splitlines()[-1])
    return loaded


def test_a_daemon_serving_a_plain_checkpoint_imports_only_what_it_uses(
    checkpoints: Checkpoints, tmp_path: Path
) -> None:
    socket = str(tmp_path / "d.sock")
    argv = ["preload", str(checkpoints.single), "--socket", socket]

    loaded = imported_by_daemon(argv, tmp_path / "notify", LAZY)

    assert loaded == []
    # It stopped cleanly: its socket removed, its arena freed.
    assert (os.path.exists(socket), shm_segments(segment_tag(socket))) == (False, [])


def test_the_admin_commands_import_neither_the_daemon_nor_what_they_do_not_use(
    plain_daemon: Daemon,
) -> None:
    socket = ["--socket", plain_daemon.socket]
    commands = [
        ["ls", *socket],
        ["info", *socket],
        ["leases", *socket],
        ["health", *socket],
        ["health", "--liveness", *socket],
        ["evict", "no-such-model", *socket],  # refused: MODEL_NOT_FOUND decoded
        ["gc", "--dry-run"],
        ["--version"],
    ]

    result = subprocess.run(
        [
            sys.executable,
            "-c",
            _ADMIN_MODULES,
            json.dumps(commands),
            json.dumps(ADMIN_LAZY),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env(),
        check=True,
    )

    assert json.loads(result.stdout.splitlines()[-1]) == {
        "codes": [0, 0, 0, 0, 0, 1, 0, 0],
        "loaded": [],
    }

"""Names in /dev/shm that the daemon does not own (issue 27, items 2 and 7).

/dev/shm is writable by every local user, and may be shared by containers with their own
mount namespaces: a name there that looks like a segment proves nothing. A daemon starts,
and ``weightcache gc`` runs, whatever is planted there; neither removes what is not its own.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from safetensors.torch import load_file

import weightcache
from tests.support import (
    Checkpoints,
    DaemonPool,
    WorkerPool,
    assert_attached,
    assert_bitwise_equal,
    health,
    run_cli,
    wait_until,
)
from weightcache.core.sockets import SHM_DIR, segment_tag

NOBODY = 65534
#: The daemon's `ready` log line (console format: ``<time> [info     ] ready  socket=…``).
READY_LINE = re.compile(r"\]\s+ready\s")
#: Above any pid_max (2^22): a pid that never runs, so a name carrying it has a dead owner.
DEAD_PID = 2**22 + 7


@contextlib.contextmanager
def planted(tag: str, victim: Path) -> Iterator[dict[str, tuple[str, str]]]:
    """Entries named ``weightcache-<tag>-…`` in /dev/shm that are not a daemon's segments:
    ``{case: (path, why the daemon must give for skipping it)}``; removed on exit."""
    prefix = os.path.join(SHM_DIR, f"weightcache-{tag}-")
    random = uuid.uuid4().hex
    # Parsed as a segment of a dead daemon: gc looks at it too.
    dead = f"{'0' * 12}-{DEAD_PID}-1-{random}"
    cases = {
        "folder": (f"{prefix}{dead}", "a folder"),
        "symlink": (f"{prefix}link-{random}", "a symlink"),
        "fifo": (f"{prefix}fifo-{random}", "a FIFO"),
    }
    if os.geteuid() == 0:
        cases["others-file"] = (f"{prefix}nobody-{random}", f"owned by uid {NOBODY}, not 0")
    try:
        os.mkdir(cases["folder"][0])
        os.symlink(victim, cases["symlink"][0])
        os.mkfifo(cases["fifo"][0])
        if "others-file" in cases:
            path = cases["others-file"][0]
            Path(path).write_bytes(b"not yours")
            os.chown(path, NOBODY, NOBODY)
        yield cases
    finally:
        for path, _ in cases.values():
            with contextlib.suppress(FileNotFoundError):
                if os.path.isdir(path) and not os.path.islink(path):
                    os.rmdir(path)
                else:
                    os.unlink(path)


def test_names_planted_in_dev_shm_neither_stop_a_start_nor_gc(
    daemons: DaemonPool, checkpoints: Checkpoints, tmp_path: Path
) -> None:
    socket = daemons.socket("planted")
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    with planted(segment_tag(socket), victim) as cases:
        daemon = daemons.start([checkpoints.single], socket=socket)
        daemon.wait_ready(models=1)

        gc = run_cli("gc")

        assert health(daemon.socket) == "SERVING"
        for path, _ in cases.values():
            assert os.path.lexists(path), path
        assert victim.read_text() == "precious\n"
        log = daemon.log()
        for case, (path, why) in cases.items():
            assert any(
                "skipped a segment name that is not ours" in line and path in line and why in line
                for line in log.splitlines()
            ), (case, log)
        assert (gc.returncode, gc.stderr) == (0, "")
        folder, why = cases["folder"]
        assert f"skipped {folder}: {why}" in gc.stdout.splitlines()
        assert not any(path in line for line in gc.stdout.splitlines() if "removed" in line)


def _in_own_mount_namespace(folder: Path) -> list[str]:
    """A command prefix that runs its command (by exec, same pid) in a new mount namespace
    where ``folder`` is a fresh, private tmpfs: the same socket path as outside, another
    socket and another lock (two containers sharing /dev/shm, each with its own /run)."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1)")
    probe = subprocess.run(
        [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            f"mount -t tmpfs -o mode=0700 weightcache-probe {folder}",
        ],
        capture_output=True,
        check=False,
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a new mount namespace: {probe.stderr!r}")
    script = f'mount -t tmpfs -o mode=0700 weightcache-ns {folder} && exec "$@"'
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh"]


def test_a_daemon_on_the_same_socket_path_in_another_mount_namespace_keeps_out(
    daemons: DaemonPool, checkpoints: Checkpoints, workers: WorkerPool, tmp_path: Path
) -> None:
    live = daemons.start([checkpoints.single])
    before = live.segments()
    assert len(before) == 1

    other = daemons.start(
        [], socket=live.socket, wait=False, wrap=_in_own_mount_namespace(daemons.sock_dir)
    )
    # Its readiness cannot be polled through the path (that reaches `live`): its log says.
    wait_until(lambda: READY_LINE.search(other.log()) is not None, timeout=60)
    assert other.proc.poll() is None, other.log()

    assert live.segments() == before
    assert "removed a dead daemon's segment" not in other.log()
    reply = workers.start().load(checkpoints.single, socket=live.socket, dump=tmp_path / "w")
    assert_attached(reply)
    assert_bitwise_equal(
        load_file(tmp_path / "w"), weightcache.load_from_disk(checkpoints.single).tensors
    )
    assert other.stop() == 0
    assert live.segments() == before

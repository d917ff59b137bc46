"""A hand-over nobody takes (issue 37, item 7), in a private /dev/shm.

``python tests/handover_orphans.py CHECKPOINT FOLDER``, run under
:func:`tests.support.private_shm` (its own tmpfs on /dev/shm, so that ``weightcache gc``
sees only this script's segments): starts a daemon with ``--hand-over`` on a socket in
FOLDER, stops it with SIGTERM (no successor comes), then runs ``weightcache gc`` as an
operator would; then again with the socket's folder full (a tmpfs of its own, filled),
so that the manifest cannot be written. Prints one JSON object: what /dev/shm held
after each step, and what each command printed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from weightcache.testing.daemon import READY_TIMEOUT, health

CLI = [sys.executable, "-m", "weightcache_service.cli"]


def read(path: str) -> str:
    with open(path, encoding="utf-8") as fh:
        return fh.read()


def shm() -> list[str]:
    return sorted(os.listdir("/dev/shm"))


def run_daemon(checkpoint: str, folder: str, log: str) -> subprocess.Popen[bytes]:
    socket = os.path.join(folder, "d.sock")
    with open(log, "ab") as out:
        daemon = subprocess.Popen(
            [*CLI, "preload", checkpoint, "--socket", socket, "--hand-over", "--headroom", "0"],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + READY_TIMEOUT
    while health(socket) != "SERVING":
        if time.monotonic() > deadline or daemon.poll() is not None:
            daemon.kill()
            raise SystemExit(f"daemon not ready:\n{read(log)}")
        time.sleep(0.1)
    return daemon


def stop(daemon: subprocess.Popen[bytes]) -> int:
    daemon.send_signal(signal.SIGTERM)
    return daemon.wait(60)


def gc(*args: str) -> str:
    done = subprocess.run([*CLI, "gc", *args], capture_output=True, text=True, check=True)
    return done.stdout


def main() -> None:
    checkpoint, folder = sys.argv[1], sys.argv[2]
    result: dict[str, object] = {}
    # 1. No successor: the segment stays under its hand-over name until gc takes it.
    plain = os.path.join(folder, "plain")
    os.mkdir(plain, 0o700)
    daemon = run_daemon(checkpoint, plain, os.path.join(folder, "plain.log"))
    result["loaded"] = shm()
    result["stopped"] = stop(daemon)
    result["handed_over"] = shm()
    result["gc_default"] = gc()
    result["after_gc_default"] = shm()
    result["gc_dry_run"] = gc("--dry-run", "--handover-grace", "0")
    result["after_dry_run"] = shm()
    result["gc"] = gc("--handover-grace", "0")
    result["after_gc"] = shm()
    # 2. The manifest cannot be written (ENOSPC): the daemon drains and frees its arenas.
    full = os.path.join(folder, "full")
    os.mkdir(full, 0o700)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700", "wc-full", full], check=True
    )
    daemon = run_daemon(checkpoint, full, os.path.join(folder, "full.log"))
    filler = os.open(os.path.join(full, "filler"), os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(filler, b"\0" * 4096)
    except OSError:
        pass
    finally:
        os.close(filler)
    result["full_stopped"] = stop(daemon)
    result["full_after"] = shm()
    result["full_log"] = read(os.path.join(folder, "full.log"))
    print(json.dumps(result))


if __name__ == "__main__":
    main()

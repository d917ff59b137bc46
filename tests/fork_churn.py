"""Fork children while other threads of this process are inside SDK calls (issue 27).

``python tests/fork_churn.py PATH SOCKET CHILDREN THREADS [AT_ONCE]``: loads PATH (its
KeepAlive stream then runs), starts THREADS threads that load and close PATH in a loop,
forks CHILDREN children one after another, each loading PATH with ``fallback=True`` and
writing what it got to a pipe, and prints one JSON object: per outcome, how many
children, and the seconds the forks took. With AT_ONCE (``1``), two children in three are
forked right after a load returns: the first load through a path of its own to the socket
(a hard link), while that path's channel and KeepAlive stream open, or a load with a lease
of its own, while its first renewal is on the wire
(issue 37: such children hung inside ``os.fork``). A child not done within
:data:`CHILD_TIMEOUT` s is killed and counted as ``hung``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time

import weightcache
from weightcache.testing.protocol import tensor_digest

#: A hang lasts for ever; a child that is merely slow (a loaded machine, another suite
#: beside this one) must not be counted as hung.
CHILD_TIMEOUT = 60.0


def child(path: str, sock: str, out: int) -> None:
    try:
        got = weightcache.load(path, socket=sock, fallback=True, wait_timeout=30)
        reason = got.fallback_reason
        msg = {
            "source": got.source,
            "reason": reason.code if reason else None,
            "detail": reason.detail if reason else None,
            "digest": tensor_digest(got.tensors),
        }
        got.close()
    except BaseException as exc:  # reported, never raised: the parent counts outcomes
        msg = {"error": repr(exc)}
    os.write(out, json.dumps(msg).encode())
    os._exit(0)


def main() -> None:
    path, sock, children, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    at_once = len(sys.argv) > 5 and sys.argv[5] == "1"
    links = tempfile.mkdtemp(prefix="wcfork", dir=os.path.dirname(os.path.dirname(sock)))
    held = weightcache.load(path, socket=sock, fallback=False)
    expected = tensor_digest(held.tensors)
    stop = threading.Event()

    def churn() -> None:
        # A TTL of each load's own: a lease of its own (not shared with ``held``), so
        # each load is an Acquire, a renewal on the KeepAlive stream and a Release.
        ttl = 30.0 + threading.get_ident() % 1000
        while not stop.is_set():
            ttl += 0.001
            weightcache.load(path, socket=sock, fallback=True, ttl=ttl).close()

    workers = [threading.Thread(target=churn, daemon=True) for _ in range(threads)]
    for worker in workers:
        worker.start()
    time.sleep(0.3)
    outcomes: dict[str, int] = {}
    details: list[str] = []
    started = time.monotonic()
    for i in range(children):
        fresh = None
        if at_once and i % 3 == 1:
            # A path of its own to the daemon's socket: a channel and a KeepAlive stream
            # of their own, opening as the fork happens.
            link = os.path.join(links, f"{i}.sock")
            os.link(sock, link)
            fresh = weightcache.load(path, socket=link, fallback=False)
        elif at_once and i % 3 == 2:
            # A TTL of its own: a lease of its own on ``held``'s stream, its first
            # renewal on the wire as the fork happens.
            fresh = weightcache.load(path, socket=sock, fallback=False, ttl=60.0 + i)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            child(path, sock, w)
        os.close(w)
        if fresh is not None:
            fresh.close()
        deadline = time.monotonic() + CHILD_TIMEOUT
        status = None
        while status is None and time.monotonic() < deadline:
            done, st = os.waitpid(pid, os.WNOHANG)
            status = st if done else None
            time.sleep(0.02)
        data = os.read(r, 1 << 20)
        os.close(r)
        if status is None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            key = "hung"
        elif os.WIFSIGNALED(status):
            key = signal.Signals(os.WTERMSIG(status)).name
        else:
            msg = json.loads(data or b"{}")
            if msg.get("source") == "cache" and msg.get("digest") == expected:
                key = "cache"
            else:
                key = msg.get("reason") or "error"
                details.append(str(msg.get("detail") or msg.get("error")))
        outcomes[key] = outcomes.get(key, 0) + 1
    stop.set()
    for worker in workers:
        worker.join(15)
    held.close()
    shutil.rmtree(links)
    seconds = round(time.monotonic() - started, 1)
    print(json.dumps({"outcomes": outcomes, "details": details, "seconds": seconds}))


if __name__ == "__main__":
    main()

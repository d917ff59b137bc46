"""Fork children while other threads of this process are inside SDK calls (issue 27).

``python tests/fork_churn.py PATH SOCKET CHILDREN THREADS``: loads PATH (its KeepAlive
stream then runs), starts THREADS threads that load and close PATH in a loop, forks
CHILDREN children one after another, each loading PATH with ``fallback=True`` and writing
what it got to a pipe, and prints one JSON object: per outcome, how many children.
A child not done within 30 s is killed and counted as ``hung``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import weightcache
from weightcache.testing.protocol import tensor_digest

CHILD_TIMEOUT = 30.0


def child(path: str, sock: str, out: int) -> None:
    try:
        got = weightcache.load(path, socket=sock, fallback=True, wait_timeout=5)
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
    held = weightcache.load(path, socket=sock, fallback=False)
    expected = tensor_digest(held.tensors)
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            weightcache.load(path, socket=sock, fallback=True).close()

    workers = [threading.Thread(target=churn, daemon=True) for _ in range(threads)]
    for worker in workers:
        worker.start()
    time.sleep(0.3)
    outcomes: dict[str, int] = {}
    details: list[str] = []
    for _ in range(children):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            child(path, sock, w)
        os.close(w)
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
    print(json.dumps({"outcomes": outcomes, "details": details}))


if __name__ == "__main__":
    main()

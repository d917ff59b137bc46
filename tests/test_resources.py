"""Out of file descriptors or memory is RESOURCE_EXHAUSTED, and a bad or shrinking segment
is INVALID_HANDLE, never SIGBUS (issue 27, item 11), in real processes.

- opening a checkpoint with every descriptor in use: ``RESOURCE_EXHAUSTED``, not
  ``INVALID_CHECKPOINT``;
- a worker whose open of a real daemon's segment the kernel refuses with ``EMFILE`` (out
  of descriptors), or whose ``mmap`` of its length with ``ENOMEM`` (zero-copy: the
  mapping; copy: the private memory for the copy), by a seccomp filter:
  ``RESOURCE_EXHAUSTED``, not ``INVALID_HANDLE``;
- a rogue daemon (a process of the worker's own uid) that truncates and re-extends its
  segment while workers copy it: each load gets the bytes or ``INVALID_HANDLE``, the
  worker never dies of ``SIGBUS`` (copy mode reads through the descriptor);
- (a NUL byte in the handle's path is ``INVALID_HANDLE``: ``tests/test_security.py``'s
  rogue-daemon cases, ``nul-byte-in-path``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import uuid

import pytest

from tests import test_security
from tests.support import Checkpoints, DaemonPool, get_model
from weightcache.testing import child_env

pytestmark = pytest.mark.timeout(120)

#: The rogue daemon of tests/test_security.py (module-scoped there, and here).
rogue = test_security.rogue

SCRIPT = r"""
import json, os, sys
from weightcache.core.checkpoint import open_checkpoint
from weightcache.core.errors import WeightCacheError

path = sys.argv[1]
held = []
try:
    while True:  # every descriptor this process may have, in use
        held.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
try:
    open_checkpoint(path)
    print(json.dumps({"reason": None}))
except WeightCacheError as err:
    print(json.dumps({"reason": err.reason, "detail": err.detail}))
"""


def run_script(script: str, *args: str, nofile: int | None = None) -> dict[str, object]:
    """Run ``script`` in a fresh Python process (under ``prlimit --nofile`` when given);
    its last line of output, as JSON."""
    wrap = [] if nofile is None else ["prlimit", f"--nofile={nofile}:{nofile}", "--"]
    run = subprocess.run(
        [*wrap, sys.executable, "-c", script, *args],
        check=False,
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=90,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got: dict[str, object] = json.loads(run.stdout.splitlines()[-1])
    return got


def test_opening_a_checkpoint_without_descriptors_is_resource_exhausted(
    checkpoints: Checkpoints,
) -> None:
    got = run_script(SCRIPT, str(checkpoints.sharded), nofile=256)
    assert got["reason"] == "RESOURCE_EXHAUSTED", got
    assert "Too many open files" in str(got["detail"]), got
    assert str(checkpoints.sharded) in str(got["detail"]) or "safetensors" in str(got["detail"])


# A worker that attached once (its channel and KeepAlive stream are open), then runs out
# of something and attaches again with fallback=False: the reason it gets.
ATTACH = r"""
import ctypes, json, os, platform, struct, sys
import weightcache
from weightcache.core.errors import WeightCacheError

path, socket, how, size = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
first = weightcache.load(path, socket=socket, fallback=False)
assert first.source == "cache"
# The kernel refuses one call from here on, as when the process is out of descriptors
# (EMFILE) or of address space or mappings (ENOMEM, vm.max_map_count): a seccomp filter
# on an argument only the segment's open (its flags) or mapping (its length) has.
machine = platform.machine()
arch = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}[machine]
if how == "emfile":
    nr = {"x86_64": 257, "aarch64": 56}[machine]  # openat
    offset, value, error = 32, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 24
else:
    nr = {"x86_64": 9, "aarch64": 222}[machine]  # mmap
    offset, value, error = 24, size, 12
ops = [
    (0x20, 0, 0, 4), (0x15, 0, 5, arch),  # another ABI: allow
    (0x20, 0, 0, 0), (0x15, 0, 3, nr),  # another call: allow
    (0x20, 0, 0, offset), (0x15, 0, 1, value),  # the argument (its low half)
    (0x06, 0, 0, 0x00050000 | error),  # SECCOMP_RET_ERRNO
    (0x06, 0, 0, 0x7FFF0000),  # SECCOMP_RET_ALLOW
]
code = b"".join(struct.pack("=HBBI", *op) for op in ops)
class Prog(ctypes.Structure):
    _fields_ = (("len", ctypes.c_ushort), ("filter", ctypes.c_void_p))
buf = ctypes.create_string_buffer(code, len(code))
prog = Prog(len(ops), ctypes.addressof(buf))
libc = ctypes.CDLL(None, use_errno=True)
assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
assert libc.prctl(22, 2, ctypes.byref(prog), 0, 0) == 0, ctypes.get_errno()
mode = "copy" if how in ("emfile", "enomem-copy") else "zero_copy"
try:
    # Another ttl: a fresh Acquire, not a share of the first load's lease.
    weightcache.load(path, socket=socket, fallback=False, mode=mode, ttl=7.0)
    out = {"reason": None}
except WeightCacheError as err:
    out = {"reason": err.reason, "detail": err.detail, "type": type(err).__name__}
first.close()
print(json.dumps(out))
"""

#: how -> (the strerror in the detail, what failed)
EXHAUSTED = {
    "emfile": ("Too many open files", "cannot open shared memory"),
    "enomem-map": ("Cannot allocate memory", "cannot map shared memory"),
    "enomem-copy": ("Cannot allocate memory", "cannot copy shared memory"),
}


@pytest.mark.parametrize("how", sorted(EXHAUSTED))
def test_a_worker_out_of_descriptors_or_memory_is_resource_exhausted(
    daemons: DaemonPool, checkpoints: Checkpoints, how: str
) -> None:
    daemon = daemons.start([checkpoints.single])
    size = get_model(daemon.socket, "single").size_bytes
    got = run_script(
        ATTACH,
        str(checkpoints.single),
        daemon.socket,
        how,
        str(size),
    )
    strerror, doing = EXHAUSTED[how]
    assert (got["reason"], got["type"]) == ("RESOURCE_EXHAUSTED", "ResourceExhaustedError"), got
    assert str(got["detail"]).startswith("/dev/shm/"), got
    assert str(got["detail"]).endswith(f"{doing}: {strerror} (in this worker process)"), got
    # The failed attach gave its lease back; the first one was released at close().
    assert get_model(daemon.socket, "single").lease_count == 0
    assert daemon.segments() != []


# Loads the rogue daemon's model in copy mode again and again while the test truncates
# and re-extends the segment: prints how each load ended.
SHRINKING = r"""
import json, sys
import weightcache

path, socket, loads = sys.argv[1], sys.argv[2], int(sys.argv[3])
ends = {}
for _ in range(loads):
    weights = weightcache.load(path, socket=socket, mode="copy")
    if weights.source == "cache":
        end = "cache"
    else:
        end = weights.fallback_reason.code + ": " + weights.fallback_reason.detail.split(": ", 1)[1]
    ends[end] = ends.get(end, 0) + 1
print(json.dumps(ends))
"""

LOADS = 300


def test_a_segment_shrinking_under_copying_workers_is_refused_not_sigbus(
    rogue: test_security.Rogue,
) -> None:
    segment = f"{test_security.ROGUE_PREFIX}shrink-{uuid.uuid4().hex}"
    rogue.scratch.append(segment)
    shutil.copyfile(rogue.segment, segment)
    reply = test_security.pb.AcquireResponse()
    reply.CopyFrom(rogue.good)
    reply.storage.shared_memory.path = segment
    rogue.servicer.reply = reply
    stop = threading.Event()

    def flap() -> None:
        fd = os.open(segment, os.O_RDWR)
        try:
            while not stop.is_set():
                os.ftruncate(fd, 0)
                os.ftruncate(fd, 512)
        finally:
            os.close(fd)

    flapper = threading.Thread(target=flap)
    flapper.start()
    try:
        ends = run_script(SHRINKING, str(rogue.model), rogue.socket, str(LOADS))
    finally:
        stop.set()
        flapper.join()
    assert sum(int(str(n)) for n in ends.values()) == LOADS, ends
    refused = {
        "INVALID_HANDLE: size 0 does not match handle 512",
        "INVALID_HANDLE: size 0 does not match handle 512 (shrank while copied)",
        "INVALID_HANDLE: size 0 does not match handle 512 (once copied)",
    }
    assert set(ends) <= {"cache"} | refused, ends

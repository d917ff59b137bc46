"""One timed load in a fresh process, for ``attach_vs_disk.py`` and ``matrix.py``.

Usage::

    python bench/attach_worker.py MODE MODEL_DIR --socket S --out F [--pt FILE]

MODE is one of attach, copy, disk, safetensors, fingerprint, rpc (``attach_vs_disk.py``)
or fallback, safe_open, torch_load, mmap (the other loaders ``matrix.py`` compares):
``fallback`` is ``weightcache.load`` with a socket no daemon listens on (``S.absent``), so
that it loads from disk with ``DAEMON_UNAVAILABLE``, the path of a worker without daemon;
``idle`` loads nothing (the imports alone: the baseline of a memory measurement);
``disk_first`` and ``fallback_first`` are ``disk`` and ``fallback`` with an empty hash
cache (``$WEIGHTCACHE_HASH_CACHE`` a new folder), as on a host where no daemon ever ran.
With ``--hold`` the worker then prints ``ready`` and keeps what it loaded until its stdin
closes, so that ``matrix.py`` can read its memory beside its siblings'.

Writes ``{"seconds", "load_seconds", "read_seconds", "source", "tensors", "touched"}`` as
JSON to ``--out``. What is timed starts after the imports: the load call, then reading the
first byte of every tensor (so a zero-copy attach pays for one page fault per tensor, not
for every byte), then every byte of every tensor (:func:`read_all`); ``load_seconds``
stops before that touch (the call returns), ``seconds`` after it, ``read_seconds`` after
every byte was read (the loaders that map files pay their page faults there). For
``safetensors`` the load is ``safetensors.torch.load_file`` of every shard; for
``fingerprint`` it is ``open_checkpoint`` plus the sampled ``compute_fingerprint``; for
``rpc``, a new gRPC channel to the daemon (``weightcache.core.rpc.connect``, as the SDK
opens it) and one ``ListModels`` call, what any first load that asks the daemon pays at
least in a fresh process (its ``tensors`` is the sum of the listed models'
``tensor_count``; nothing is touched). The
other peers, each followed by the same touch: ``safe_open`` is ``safetensors.safe_open`` +
``get_tensor`` of every tensor of every shard; ``torch_load`` is
``torch.load(FILE, mmap=True, weights_only=True)`` of the ``--pt`` file (written beforehand
with the same tensors); ``mmap`` maps every shard (``mmap.ACCESS_COPY``, private and
writable, so ``torch.frombuffer`` takes it without a warning), parses its header and builds
one ``torch.frombuffer`` view per tensor: about the least a Python loader can do.
Releasing the lease (``close()``) is not timed.

``weightcache``'s attributes are imported on first use (PEP 562): each one used is resolved
before the clock starts, else the first ``weightcache.load`` inside the timed region would
import the loader, gRPC and the protos (about 150 ms) and be counted as attach time.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import safetensors.torch
import torch

import weightcache
from weightcache import Placement, Recipe
from weightcache.core import rpc
from weightcache.core.dtypes import TORCH_DTYPES
from weightcache.core.fingerprint import DEFAULT_LEVEL, LEVELS, Level
from weightcache.v1 import weight_cache_service_pb2 as pb

#: Seconds the rpc mode's call may take.
RPC_TIMEOUT = 60.0

MODES = (
    "attach", "copy", "disk", "fallback", "safetensors", "fingerprint", "rpc", "safe_open",
    "torch_load", "mmap", "idle", "disk_first", "fallback_first",
)  # fmt: skip
#: Suffix of a mode run with an empty hash cache: a first load, no daemon ever ran here.
FIRST = "_first"


def touch(tensors: dict[str, torch.Tensor]) -> int:
    """Sum of the first byte of every non-empty (CPU) tensor: makes each tensor's first
    page resident. The byte is read at the tensor's address (``ctypes.string_at``), about
    0.5 µs a tensor; indexing each tensor in torch, as this did until 2026-12-01, cost
    about 6 µs, more than an attach of the tensor itself."""
    read = ctypes.string_at
    return sum(read(t.data_ptr(), 1)[0] for t in tensors.values() if t.numel())


#: What :func:`timed` loaded, kept alive until the process ends (``--hold``).
KEPT: list[dict[str, torch.Tensor]] = []
#: Bytes :func:`read_all` copies at a time (its scratch buffer, allocated before the clock).
READ_CHUNK = 1 << 20
_SCRATCH = ctypes.create_string_buffer(READ_CHUNK)


def read_all(tensors: dict[str, torch.Tensor]) -> int:
    """Read every byte of every (CPU) tensor: ``memmove`` it, a chunk at a time, into one
    scratch buffer allocated before the clock, so that a mapped tensor pays for all its
    page faults and a copied one for its memory traffic, and nothing is allocated.
    Returns the bytes read."""
    move, scratch, total = ctypes.memmove, _SCRATCH, 0
    for tensor in tensors.values():
        address, left = tensor.data_ptr(), tensor.nbytes
        total += left
        while left > 0:
            step = min(left, READ_CHUNK)
            move(scratch, address, step)
            address += step
            left -= step
    return total


def load_and_touch(
    mode: str, model_dir: str, socket: str, level: Level = DEFAULT_LEVEL
) -> dict[str, object]:
    """Load in ``mode`` (``attach`` and ``copy`` at fingerprint ``level``) and touch;
    returns the result fields, ``seconds`` included."""
    load, load_from_disk = weightcache.load, weightcache.load_from_disk  # before the clock
    loaders: dict[str, Callable[[], weightcache.LoadedWeights]] = {
        "attach": lambda: load(model_dir, socket=socket, fallback=False, fingerprint_level=level),
        "copy": lambda: load(
            model_dir, socket=socket, mode="copy", fallback=False, fingerprint_level=level
        ),
        "disk": lambda: load_from_disk(model_dir),
        # load()'s own fallback: no daemon answers on this socket (DAEMON_UNAVAILABLE).
        "fallback": lambda: load(model_dir, socket=f"{socket}.absent", fingerprint_level=level),
    }
    held: list[weightcache.LoadedWeights] = []

    def loaded() -> dict[str, torch.Tensor]:
        held.append(loaders[mode]())
        return held[0].tensors

    result = timed(loaded, "")
    result["source"] = held[0].source
    held[0].close()
    return result


def timed(load: Callable[[], dict[str, torch.Tensor]], source: str) -> dict[str, object]:
    """Time ``load`` alone (``load_seconds``), with the touch of what it returns
    (``seconds``), and then with every byte of it read (``read_seconds``, from the same
    start: the load, the touch, then :func:`read_all`); the result fields."""
    start = time.perf_counter()
    tensors = load()
    KEPT.append(tensors)  # for --hold; after the clock stopped
    loaded = time.perf_counter()
    touched = touch(tensors)
    seconds = time.perf_counter() - start
    read_all(tensors)
    read_seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "load_seconds": loaded - start,
        "read_seconds": read_seconds,
        "source": source,
        "tensors": len(tensors),
        "touched": touched,
    }


def shards(model_dir: str) -> list[str]:
    """The checkpoint's safetensors files: the shards its index names, or the one file."""
    folder = Path(model_dir)
    index = folder / "model.safetensors.index.json"
    if not index.exists():
        return [str(folder / "model.safetensors")]
    names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return [str(folder / name) for name in names]


def safetensors_and_touch(model_dir: str) -> dict[str, object]:
    """``safetensors.torch.load_file`` of every shard and touch (the reference loader);
    returns the result fields. Listing the shards is not timed."""
    return _per_shard(model_dir, safetensors.torch.load_file)


def safe_open_and_touch(model_dir: str) -> dict[str, object]:
    """``safetensors.safe_open`` of every shard, ``get_tensor`` of each of its tensors, and
    touch; returns the result fields. Listing the shards is not timed."""
    files = shards(model_dir)
    safe_open = safetensors.safe_open

    def load() -> dict[str, torch.Tensor]:
        tensors: dict[str, torch.Tensor] = {}
        for path in files:
            with safe_open(path, framework="pt") as shard:
                for name in shard.keys():  # noqa: SIM118 (a safe_open handle is no dict)
                    tensors[name] = shard.get_tensor(name)
        return tensors

    return timed(load, "disk")


def torch_load_and_touch(pt_file: str) -> dict[str, object]:
    """``torch.load(pt_file, mmap=True, weights_only=True)`` and touch; returns the result
    fields."""
    load = torch.load
    return timed(lambda: load(pt_file, mmap=True, weights_only=True), "disk")


def mmap_views(path: str) -> dict[str, torch.Tensor]:
    """Map the safetensors file ``path`` (private, copy-on-write) and return one
    ``torch.frombuffer`` view per tensor, from its header; no checks beyond the dtype."""
    with open(path, "rb") as file:
        mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
    size = int.from_bytes(mapped[:8], "little")
    header = json.loads(mapped[8 : 8 + size])
    base = 8 + size
    tensors: dict[str, torch.Tensor] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = TORCH_DTYPES[info["dtype"]]
        begin, end = info["data_offsets"]
        count = (end - begin) // dtype.itemsize
        if count:
            flat = torch.frombuffer(mapped, dtype=dtype, count=count, offset=base + begin)
            tensors[name] = flat.view(info["shape"])
        else:
            tensors[name] = torch.empty(info["shape"], dtype=dtype)
    return tensors


def mmap_and_touch(model_dir: str) -> dict[str, object]:
    """:func:`mmap_views` of every shard and touch; returns the result fields. Listing the
    shards is not timed."""
    return _per_shard(model_dir, mmap_views)


def _per_shard(
    model_dir: str, load_shard: Callable[[str], dict[str, torch.Tensor]]
) -> dict[str, object]:
    """Time ``load_shard`` of every shard then the touch; the result fields."""
    files = shards(model_dir)  # before the clock

    def load() -> dict[str, torch.Tensor]:
        tensors: dict[str, torch.Tensor] = {}
        for path in files:
            tensors.update(load_shard(path))
        return tensors

    return timed(load, "disk")


def fingerprint_only(model_dir: str) -> dict[str, object]:
    """Time ``open_checkpoint`` plus the sampled fingerprint; returns the result fields."""
    open_checkpoint = weightcache.open_checkpoint  # resolved before the clock
    compute_fingerprint = weightcache.compute_fingerprint
    start = time.perf_counter()
    checkpoint = open_checkpoint(model_dir)
    fp = compute_fingerprint(checkpoint, Recipe(), Placement(), "sampled")
    seconds = time.perf_counter() - start
    tensors = len(checkpoint.tensors)
    return {
        "seconds": seconds,
        "load_seconds": seconds,
        "source": "-",
        "tensors": tensors,
        "touched": fp.digest[:12],
    }


def ask_daemon(socket: str) -> tuple[grpc.Channel, int]:
    """Open a channel to the daemon as the SDK does (``weightcache.core.rpc.connect``) and
    make one ``ListModels`` call: the least a first load that asks the daemon pays in a
    fresh process. Returns the channel (open) and the listed models' tensor count."""
    channel, stub = rpc.connect(socket)
    reply = stub.ListModels(pb.ListModelsRequest(), timeout=RPC_TIMEOUT)
    return channel, sum(model.tensor_count for model in reply.models)


def rpc_only(socket: str) -> dict[str, object]:
    """Time :func:`ask_daemon`; returns the result fields (nothing is touched)."""
    start = time.perf_counter()
    channel, tensors = ask_daemon(socket)
    seconds = time.perf_counter() - start
    channel.close()
    return {
        "seconds": seconds,
        "load_seconds": seconds,
        "source": "-",
        "tensors": tensors,
        "touched": 0,
    }


def main() -> None:
    """Parse the arguments, run one timed load, write the JSON result."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=MODES)
    parser.add_argument("model_dir")
    parser.add_argument("--socket", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--pt", help="the torch.save file of the same tensors (torch_load)")
    parser.add_argument(
        "--level", choices=LEVELS, default=DEFAULT_LEVEL, help="fingerprint level (attach, copy)"
    )
    parser.add_argument(
        "--hold",
        action="store_true",
        help="after the result, print 'ready' and keep the weights until stdin closes",
    )
    args = parser.parse_args()
    if args.mode == "torch_load" and not args.pt:
        parser.error("torch_load needs --pt")
    if args.mode == "idle":
        result = {"seconds": 0.0, "load_seconds": 0.0, "read_seconds": 0.0, "source": "-"}
        result |= {"tensors": 0, "touched": 0}
    elif args.mode == "fingerprint":
        result = fingerprint_only(args.model_dir)
    elif args.mode == "safetensors":
        result = safetensors_and_touch(args.model_dir)
    elif args.mode == "safe_open":
        result = safe_open_and_touch(args.model_dir)
    elif args.mode == "torch_load":
        result = torch_load_and_touch(args.pt)
    elif args.mode == "mmap":
        result = mmap_and_touch(args.model_dir)
    elif args.mode == "rpc":
        result = rpc_only(args.socket)
    elif args.mode.endswith(FIRST):
        with tempfile.TemporaryDirectory(prefix="hash-cache-") as empty:
            os.environ["WEIGHTCACHE_HASH_CACHE"] = empty  # read at each lookup
            mode = args.mode.removesuffix(FIRST)
            result = load_and_touch(mode, args.model_dir, args.socket, args.level)
    else:
        result = load_and_touch(args.mode, args.model_dir, args.socket, args.level)
    with open(args.out, "w") as out:
        json.dump(result, out)
    if args.hold:
        # Every byte of what was loaded is read by now: the parent reads this process's
        # /proc/PID/smaps_rollup while it and its siblings hold their weights.
        print("ready", flush=True)
        sys.stdin.read()


if __name__ == "__main__":
    main()

"""Time to weights-ready on a GPU: CUDA IPC attach vs copy vs disk, on a generated checkpoint.

Run with ``.venv/bin/python bench/gpu_attach.py [--size-gib 8] [--device cuda:0]``. Where
torch sees no CUDA/ROCm device it says so and exits 0 without doing anything.

1. generate a sharded safetensors checkpoint (``--size-gib``, default 8, of ``--tensors``
   BF16/F16/F32 tensors in ``--shards`` files plus the index; the generator of
   ``attach_vs_disk.py``) in a temporary folder under /tmp;
2. start ``weightcache preload <folder> --device <device>`` and wait until it is healthy;
3. verify once, in one worker: every tensor of a zero-copy attach is on the device and
   bitwise equal to the disk load moved to the device;
4. run this file with ``--worker MODE`` ``--repeat`` times per mode, modes interleaved,
   each run a fresh process, and time, after its imports and after creating its CUDA
   context (every mode pays for those alike, so they are left out):

   - ``attach``: ``weightcache.load(dir, socket=S)``, zero-copy views of the daemon's arena;
   - ``copy``: ``weightcache.load(dir, socket=S, mode="copy")``, a device-to-device copy;
   - ``disk``: ``weightcache.load_from_disk(dir)`` then ``.to(device)`` of every tensor,
     what a worker that falls back does;
   - ``safetensors``: ``safetensors.torch.load_file(shard, device=device)`` per shard, the
     usual direct load;

   each ends with ``torch.cuda.synchronize(device)``;
5. print median and min per mode and the disk median divided by each mode's median;
6. stop the daemon with SIGTERM, check it exited 0 and removed its socket, remove the folder
   (also on failure and Ctrl-C).

The page cache is warm for ``disk`` and ``safetensors`` (the files were just written and
read by the daemon): their best case.
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Literal

import torch

# bench/ is sys.path[0] when this file runs as a script.
from attach_vs_disk import (
    BenchError,
    generate,
    machine_line,
    new_checkpoint,
    preloaded,
    print_table,
    run_child,
    run_script,
)

MODES = ("attach", "copy", "disk", "safetensors")
TIMED = {
    "attach": "weightcache.load(dir, socket=S) [zero_copy, IPC views] + synchronize",
    "copy": 'weightcache.load(dir, socket=S, mode="copy") [device-to-device] + synchronize',
    "disk": "weightcache.load_from_disk(dir) + .to(device) of every tensor + synchronize",
    "safetensors": "safetensors.torch.load_file(shard, device=device) per shard + synchronize",
}
#: Seconds one worker run may take.
WORKER_TIMEOUT = 900.0


# -- the worker (this file with --worker MODE) -----------------------------------------


def _raw(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def _shards(model_dir: str) -> list[str]:
    index = json.loads((Path(model_dir) / "model.safetensors.index.json").read_text())
    return [str(Path(model_dir) / name) for name in sorted(set(index["weight_map"].values()))]


def _load(mode: str, model_dir: str, socket: str, device: torch.device) -> dict[str, Any]:
    """Load in ``mode``; returns the tensors and where they came from (not timed here)."""
    import weightcache

    if mode in ("attach", "copy"):
        kind: Literal["zero_copy", "copy"] = "zero_copy" if mode == "attach" else "copy"
        weights = weightcache.load(model_dir, socket=socket, mode=kind, fallback=False)
        return {"tensors": weights.tensors, "source": weights.source, "keep": weights}
    if mode == "disk":
        weights = weightcache.load_from_disk(model_dir)
        tensors = {name: t.to(device) for name, t in weights.tensors.items()}
        return {"tensors": tensors, "source": weights.source, "keep": None}
    from safetensors.torch import load_file

    tensors = {}
    for shard in _shards(model_dir):
        tensors.update(load_file(shard, device=str(device)))
    return {"tensors": tensors, "source": "disk", "keep": None}


def _import_loaders() -> None:
    """Import what :func:`_load` uses, before the clock starts: ``weightcache``'s attributes
    load on first use (PEP 562), and the first ``weightcache.load`` would otherwise import
    the loader, gRPC and the protos (about 150 ms) inside the timed region."""
    import safetensors.torch  # noqa: F401  # imported for its side effect: loaded once

    import weightcache

    weightcache.load, weightcache.load_from_disk  # noqa: B018  # resolves the lazy imports


def worker(mode: str, model_dir: str, socket: str, device_name: str) -> dict[str, Any]:
    """One timed load (or, for ``verify``, the bitwise check); returns the JSON result."""
    device = torch.device(device_name)
    _import_loaders()
    torch.cuda.init()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
    torch.empty(1, device=device)  # the CUDA context exists before the clock starts
    torch.cuda.synchronize(device)
    if mode == "verify":
        return verify(model_dir, socket, device)
    start = time.perf_counter()
    loaded = _load(mode, model_dir, socket, device)
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    tensors = loaded["tensors"]
    on_device = all(t.device == device for t in tensors.values())
    if loaded["keep"] is not None:
        loaded["keep"].close()
    return {
        "seconds": seconds,
        "source": loaded["source"],
        "tensors": len(tensors),
        "on_device": on_device,
    }


def verify(model_dir: str, socket: str, device: torch.device) -> dict[str, Any]:
    """Attach zero-copy and load from disk; compare every tensor's bytes on the device."""
    attached = _load("attach", model_dir, socket, device)
    disk = _load("disk", model_dir, socket, device)["tensors"]
    tensors = attached["tensors"]
    differ = [
        name
        for name, tensor in tensors.items()
        if name not in disk
        or tensor.dtype != disk[name].dtype
        or tensor.shape != disk[name].shape
        or not torch.equal(_raw(tensor), _raw(disk[name]))
    ]
    result = {
        "source": attached["source"],
        "tensors": len(tensors),
        "on_device": all(t.device == device for t in tensors.values()),
        "same_names": sorted(tensors) == sorted(disk),
        "differ": differ[:10],
        "bytes": sum(t.nbytes for t in tensors.values()),
    }
    attached["keep"].close()
    return result


# -- the driver ----------------------------------------------------------------------------


def run_worker(mode: str, model: Path, socket: str, device: str) -> dict[str, Any]:
    """This file with ``--worker MODE`` in a fresh process; returns its JSON result.

    Raises:
        BenchError: the worker failed or ran over :data:`WORKER_TIMEOUT` seconds.
    """
    command = [sys.executable, __file__, "--worker", mode, str(model), "--socket", socket]
    command += ["--device", device]
    done = run_child(command, mode, WORKER_TIMEOUT)
    if done.returncode != 0:
        raise BenchError(f"{mode} worker exited {done.returncode}:\n{done.stdout}{done.stderr}")
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


def check_verify(result: dict[str, Any], expected: int) -> None:
    """Raises BenchError unless the attach was from the cache, on the device, and bitwise
    the disk load."""
    ok = (
        result["source"] == "cache"
        and result["tensors"] == expected
        and result["on_device"]
        and result["same_names"]
        and not result["differ"]
    )
    if not ok:
        raise BenchError(f"attach is not bitwise the disk load on the device: {result}")


def measure(
    model: Path, socket: str, device: str, *, repeat: int, expected: int
) -> dict[str, list[float]]:
    """Every mode ``repeat`` times, interleaved; returns seconds per mode.

    Raises:
        BenchError: a worker failed, loaded from the wrong source, saw the wrong number of
            tensors, or got tensors that are not on the device.
    """
    seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(repeat):
        for mode in MODES:
            result = run_worker(mode, model, socket, device)
            want = "cache" if mode in ("attach", "copy") else "disk"
            if (result["source"], result["tensors"], result["on_device"]) != (
                want,
                expected,
                True,
            ):
                raise BenchError(
                    f"{mode}: expected {expected} tensors on {device} from {want}: {result}"
                )
            seconds[mode].append(result["seconds"])
    return seconds


def print_results(seconds: dict[str, list[float]]) -> None:
    """Median and min per mode, and the disk median over each median."""
    note = (
        "  timed, in each worker after its imports and its CUDA context (interpreter",
        "  start, imports, context creation and close() of the lease are not):",
    )
    print_table(seconds, TIMED, 13, note)


def describe_device(device: torch.device) -> str:
    """Name, UUID and runtime versions of the device, for the header."""
    from weightcache.core.cuda import device_uuid, is_rocm

    index = device.index if device.index is not None else torch.cuda.current_device()
    runtime = f"HIP {torch.version.hip}" if is_rocm() else f"CUDA {torch.version.cuda}"
    driver = ""
    smi = shutil.which("nvidia-smi")
    if smi is not None and not is_rocm():
        done = subprocess.run(
            [smi, "--query-gpu=driver_version", "--format=csv,noheader", f"--id={index}"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if done.returncode == 0 and done.stdout.strip():
            driver = f", driver {done.stdout.strip()}"
    name = torch.cuda.get_device_name(index)
    return f"{name} ({device_uuid(index)}), torch {torch.__version__}, {runtime}{driver}"


def run_bench(args: argparse.Namespace, tmp: Path) -> bool:
    """Steps 1-5 of the module docstring; True once done (a failure raises)."""
    device = torch.device(args.device)
    folder, specs = new_checkpoint(tmp, args.tensors, int(args.size_gib * 2**30), args.seed)
    total = sum(s.nbytes for s in specs)
    print("weightcache GPU benchmark: time to weights-ready, attach vs copy vs disk")
    print(machine_line(with_torch=False))
    print(f"  device: {args.device} = {describe_device(device)}")
    print(f"  checkpoint: {total / 2**30:.2f} GiB, {len(specs)} tensors, {args.shards} shards")
    print("  page cache: WARM for disk and safetensors (files just written, daemon read them)")
    print(f"  runs: {args.repeat} per mode, modes interleaved, each in a fresh process")
    generate(folder, specs, args)
    with preloaded(folder, tmp, args=["--device", args.device], timeout=1800) as daemon:
        checked = run_worker("verify", folder, daemon.socket, args.device)
        check_verify(checked, len(specs))
        print(
            f"  verified: attach == disk load, bitwise, on {args.device}: "
            f"{checked['tensors']} tensors, {checked['bytes'] / 2**30:.2f} GiB"
        )
        print()
        seconds = measure(
            folder, daemon.socket, args.device, repeat=args.repeat, expected=len(specs)
        )
    print()
    print_results(seconds)
    return True


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-gib", type=float, default=8.0, help="checkpoint size, GiB")
    parser.add_argument("--tensors", type=int, default=1000, help="number of tensors")
    parser.add_argument("--shards", type=int, default=4, help="number of shard files")
    parser.add_argument("--repeat", type=int, default=3, help="runs per mode")
    parser.add_argument("--seed", type=int, default=0, help="seed of shapes and values")
    parser.add_argument("--device", default="cuda:0", help="cuda:N, as this process numbers it")
    parser.add_argument("--worker", choices=(*MODES, "verify"), help=argparse.SUPPRESS)
    parser.add_argument("model_dir", nargs="?", help=argparse.SUPPRESS)
    parser.add_argument("--socket", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if min(args.tensors, args.shards, args.repeat) < 1 or args.size_gib <= 0:
        parser.error("--size-gib, --tensors, --shards and --repeat must be positive")
    if args.shards > args.tensors:
        parser.error("--shards must not exceed --tensors")
    if not args.device.startswith("cuda:") or not args.device[5:].isdigit():
        parser.error("--device takes cuda:N")
    return args


def main() -> int:
    """Run the benchmark (or, with ``--worker``, one timed load); returns the exit status."""
    args = parse_args()
    if args.worker is not None:
        print(json.dumps(worker(args.worker, args.model_dir, args.socket, args.device)))
        return 0
    if not torch.cuda.is_available():
        print(f"skipped: torch {torch.__version__} sees no CUDA/ROCm device; nothing to measure")
        return 0
    if int(args.device[5:]) >= torch.cuda.device_count():
        print(f"--device {args.device}: only {torch.cuda.device_count()} visible", file=sys.stderr)
        return 2
    body = functools.partial(run_bench, args)
    return 0 if run_script("wcgpubench-", body, (BenchError,)) else 1


if __name__ == "__main__":
    sys.exit(main())

"""What a miss costs an engine: vLLM's ``load_model`` with load format ``weightcache`` when
the daemon cannot serve it, against vLLM's default loader (issue 38).

Run in the vLLM venv: ``.venv-vllm/bin/python bench/vllm_miss.py [options]``
(``make setup-vllm`` makes it).

1. write a random-weight Llama (``bench/vllm_load.py``'s, ``--layers`` layers of hidden
   size 2048, ``--dtype``) under /tmp;
2. start one daemon holding it through ``--recipe vllm:dtype=float32`` (another dtype than
   the engines' ``--dtype``: a held model that is not the one the engine asks for);
3. ``--rounds`` rounds, interleaved, of one fresh process per case, each timing vLLM's
   ``load_model`` alone, as ``bench/vllm_load.py`` does: ``none`` (load format
   ``weightcache``, no daemon at its socket: DAEMON_UNAVAILABLE, then the default
   loader), ``mismatch`` (load format ``weightcache`` against that daemon:
   FINGERPRINT_MISMATCH on the vLLM-named path, MODEL_NOT_FOUND on the checkpoint
   tensors, then the default loader) and ``auto`` (vLLM's default loader);
4. print the medians and each miss's ratio to ``auto``.

Goal (issue 38): a miss costs what the default loader costs, at most 1.1x.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_load import bench_model, start_daemon, wait_ready, workers

CASES = ("none", "mismatch", "auto")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="weightcache-bench-") as tmp:
        run(Path(tmp), args)


def run(tmp: Path, args: argparse.Namespace) -> None:
    sockets, model, nbytes = bench_model(tmp, args.layers, args.dtype)
    print(f"model: {args.layers} layers, {nbytes / 1e6:.0f} MB {args.dtype}; {os.cpu_count()} CPUs")
    other = "float32" if args.dtype != "float32" else "bfloat16"
    held = str(sockets / "held.sock")
    daemon = start_daemon(model, held, ["--recipe", f"vllm:dtype={other}"])
    try:
        print(f"daemon (--recipe vllm:dtype={other}) ready in {wait_ready(held):.1f} s")
        socket_of = {"none": str(sockets / "absent.sock"), "mismatch": held, "auto": held}
        times: dict[str, list[float]] = {case: [] for case in CASES}
        for _ in range(args.rounds):
            for case in CASES:
                path = "auto" if case == "auto" else "vllm"
                with workers(model, path, socket_of[case], args.dtype, 1) as (result,):
                    times[case].append(result["load_model_s"])
    finally:
        daemon.terminate()
        daemon.wait(timeout=120)
    print("\nload_model (create + load + process), seconds, fresh process each:")
    print(f"{'case':<10}{'median':>9}{'min':>9}   runs")
    for case in CASES:
        runs = " ".join(f"{t:.3f}" for t in times[case])
        print(f"{case:<10}{statistics.median(times[case]):>9.3f}{min(times[case]):>9.3f}   {runs}")
    auto, fastest = statistics.median(times["auto"]), min(times["auto"])
    for case in ("none", "mismatch"):
        ratio = statistics.median(times[case]) / auto
        print(
            f"{case} / default: {ratio:.2f}x median, {min(times[case]) / fastest:.2f}x min "
            "(goal <= 1.10x)"
        )


if __name__ == "__main__":
    main()

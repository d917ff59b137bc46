#!/usr/bin/env bash
# The GPU checks of weightcache's CUDA IPC backend, in a few minutes, on a machine with a
# CUDA (or ROCm) device. Run from anywhere:
#
#   tests/gpu/run_gpu_checks.sh
#   PYTHON=/path/to/python tests/gpu/run_gpu_checks.sh     # a python whose torch sees the GPU
#
# Which python:
#   - $PYTHON if set. Nothing is installed into it: its torch must see a device, and the
#     other dependencies must be there (the script says which are missing and how to add
#     them). This checkout is put first on PYTHONPATH, so it is what gets tested.
#   - else .venv/bin/python, if its torch sees a device;
#   - else the venv $GPU_VENV (default ~/.cache/weightcache/gpu-venv), created when its torch
#     does not see a device: `pip install torch` (a CUDA build from PyPI on Linux x86_64;
#     set TORCH_INDEX_URL, e.g. https://download.pytorch.org/whl/cu128, when the default
#     index gives a CPU build, and TORCH_SPEC to pin, e.g. torch==2.13.0), then this
#     package with its dev extra (which keeps that torch).
#
# Steps, each printed in full; the exit status is 1 when any step failed:
#   1. the machine: GPUs (nvidia-smi / rocm-smi), python, torch, CUDA/HIP, each device's
#      UUID as weightcache writes it and the index it maps back to;
#   2. pytest tests/gpu tests/test_cuda_cpu.py -v -rs, with WEIGHTCACHE_REQUIRE_GPU=1 (a
#      GPU test skipped for want of a device is an error, not a pass);
#   3. bench/gpu_attach.py --size-gib $SIZE_GIB (default 8; BENCH=0 skips it).
# Everything is also written to $LOG (default /tmp/weightcache-gpu-checks-<time>.log).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# A relative PYTHON path means relative to where the script was started from.
if [[ "${PYTHON:-}" == */* ]]; then PYTHON="$(realpath -s "$PYTHON")"; fi
cd "$ROOT" || exit 2
LOG="${LOG:-/tmp/weightcache-gpu-checks-$(date +%Y%m%d-%H%M%S).log}"
exec > >(tee -a "$LOG") 2>&1

GPU_VENV="${GPU_VENV:-$HOME/.cache/weightcache/gpu-venv}"
SIZE_GIB="${SIZE_GIB:-8}"
BENCH="${BENCH:-1}"
DEPS="grpc grpc_status grpc_health grpc_reflection google.protobuf structlog safetensors numpy pytest pytest_timeout"

section() { printf '\n=== %s ===\n' "$*"; }

sees_gpu() {
    "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1
}

missing_deps() {
    "$1" - $DEPS <<'EOF'
import importlib, sys
missing = []
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except ImportError:
        missing.append(name)
print(" ".join(missing))
EOF
}

make_gpu_venv() {
    section "creating $GPU_VENV"
    python3 -m venv "$GPU_VENV" || return 1
    "$GPU_VENV/bin/python" -m pip install --upgrade pip || return 1
    local index=()
    if [[ -n "${TORCH_INDEX_URL:-}" ]]; then index=(--index-url "$TORCH_INDEX_URL"); fi
    "$GPU_VENV/bin/python" -m pip install ${index[@]+"${index[@]}"} "${TORCH_SPEC:-torch}" || return 1
    "$GPU_VENV/bin/python" -m pip install -e "$ROOT[dev]" || return 1
}

pick_python() {
    if [[ -n "${PYTHON:-}" ]]; then
        if sees_gpu "$PYTHON"; then PY="$PYTHON"; return 0; fi
        echo "PYTHON=$PYTHON: torch there sees no CUDA/ROCm device (or cannot be imported);"
        echo "nothing is installed into a python given by PYTHON. Unset PYTHON to use a venv."
        return 1
    fi
    if [[ -x .venv/bin/python ]] && sees_gpu .venv/bin/python; then PY=.venv/bin/python; return 0; fi
    if [[ -x "$GPU_VENV/bin/python" ]] && sees_gpu "$GPU_VENV/bin/python"; then
        PY="$GPU_VENV/bin/python"
        return 0
    fi
    make_gpu_venv || { echo "could not set up $GPU_VENV"; return 1; }
    if sees_gpu "$GPU_VENV/bin/python"; then PY="$GPU_VENV/bin/python"; return 0; fi
    echo "torch in $GPU_VENV sees no device: a CPU build (set TORCH_INDEX_URL), no driver,"
    echo "or CUDA_VISIBLE_DEVICES hides every GPU. nvidia-smi says:"
    nvidia-smi -L 2>&1 || true
    return 1
}

section "weightcache GPU checks, $(date -u +%Y-%m-%dT%H:%M:%SZ), log: $LOG"
echo "checkout: $ROOT ($(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')," \
    "$(git -C "$ROOT" status --porcelain 2>/dev/null | wc -l) uncommitted paths)"
pick_python || exit 2
echo "python: $PY"
export PYTHONPATH="$ROOT/client:$ROOT/cache_service:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
missing="$(missing_deps "$PY")"
if [[ -n "$missing" ]]; then
    echo "missing in $PY: $missing"
    echo "add them (keeps its torch): $PY -m pip install -e '$ROOT[dev]'"
    exit 2
fi

declare -A STATUS=()

section "1. machine"
uname -srm
echo "CPUs: $(nproc), memory: $(free -g | awk '/^Mem:/ {print $2 " GiB"}')"
if command -v nvidia-smi >/dev/null; then
    nvidia-smi -L
    nvidia-smi --query-gpu=index,name,uuid,driver_version,memory.total,memory.used \
        --format=csv
fi
if command -v rocm-smi >/dev/null; then rocm-smi --showproductname --showuniqueid; fi
"$PY" - <<'EOF'
import os
import platform

import torch

from weightcache.core.cuda import device_uuid, is_rocm, local_index

print(f"python {platform.python_version()}, torch {torch.__version__}, "
      f"{'HIP ' + str(torch.version.hip) if is_rocm() else 'CUDA ' + str(torch.version.cuda)}")
for name in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"):
    print(f"{name}={os.environ.get(name, '<unset>')}")
for i in range(torch.cuda.device_count()):
    props = torch.cuda.get_device_properties(i)
    uuid = device_uuid(i)
    print(f"cuda:{i}: {props.name}, {props.total_memory / 2**30:.1f} GiB, "
          f"torch uuid {str(props.uuid)!r} -> weightcache {uuid} -> index {local_index(uuid)}")
EOF
STATUS[machine]=$?

section "2. pytest tests/gpu tests/test_cuda_cpu.py"
start=$SECONDS
WEIGHTCACHE_REQUIRE_GPU=1 "$PY" -m pytest tests/gpu tests/test_cuda_cpu.py -v -rs
STATUS[pytest]=$?
echo "pytest: exit ${STATUS[pytest]} after $((SECONDS - start)) s"

if [[ "$BENCH" != 0 ]]; then
    section "3. bench/gpu_attach.py --size-gib $SIZE_GIB"
    start=$SECONDS
    "$PY" bench/gpu_attach.py --size-gib "$SIZE_GIB"
    STATUS[bench]=$?
    echo "bench: exit ${STATUS[bench]} after $((SECONDS - start)) s"
fi

section "summary"
failed=0
for step in machine pytest bench; do
    [[ -v "STATUS[$step]" ]] || continue
    if [[ "${STATUS[$step]}" == 0 ]]; then echo "$step: ok"; else echo "$step: FAILED"; failed=1; fi
done
echo "log: $LOG"
exit "$failed"

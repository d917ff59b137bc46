"""GPU tests: real daemons started with ``--device cuda:0``, real workers on the device.

Every test marked ``gpu`` is skipped, with the reason "needs a CUDA/ROCm device", where
torch sees no device. With ``WEIGHTCACHE_REQUIRE_GPU=1`` (``run_gpu_checks.sh`` sets it)
that is an error instead, so that a GPU run cannot pass by skipping everything.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import torch

from weightcache.core.cuda import is_rocm

NEEDS_DEVICE = "needs a CUDA/ROCm device"
REQUIRE_ENV = "WEIGHTCACHE_REQUIRE_GPU"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items or torch.cuda.is_available():
        return
    if os.environ.get(REQUIRE_ENV) == "1":
        raise pytest.UsageError(
            f"{REQUIRE_ENV}=1, but torch {torch.__version__} sees no CUDA/ROCm device "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')})"
        )
    skip = pytest.mark.skip(reason=NEEDS_DEVICE)
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def smi_uuids() -> list[str] | None:
    """The GPUs' UUIDs as ``nvidia-smi`` prints them (all GPUs, whatever
    ``CUDA_VISIBLE_DEVICES`` says); None without nvidia-smi or on ROCm."""
    smi = shutil.which("nvidia-smi")
    if smi is None or is_rocm():
        return None
    done = subprocess.run(
        [smi, "--query-gpu=uuid", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if done.returncode != 0:
        return None
    return [line.strip() for line in done.stdout.splitlines() if line.strip()]

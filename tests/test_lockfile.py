"""The venv running the tests holds exactly the versions of its lock file (issue 35)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.lockfile import differences, pins

ROOT = Path(__file__).resolve().parent.parent
#: The venvs `make` creates, by folder name, and the lock each is made from.
LOCKS = {".venv": "dev.txt", ".venv-demo": "demo.txt", ".venv-vllm": "vllm.txt"}


def test_this_venv_holds_exactly_its_lock() -> None:
    venv = Path(sys.prefix)
    if venv.parent != ROOT or venv.name not in LOCKS:
        pytest.skip(f"{venv} is not one of the venvs make creates here ({', '.join(LOCKS)})")
    assert differences(ROOT / "locks" / LOCKS[venv.name]) == []


def test_every_lock_pins_torch_s_cpu_build() -> None:
    torch = pins(ROOT / "locks" / "constraints.txt")["torch"]
    assert torch.endswith("+cpu")
    for lock in LOCKS.values():
        assert pins(ROOT / "locks" / lock)["torch"] == torch

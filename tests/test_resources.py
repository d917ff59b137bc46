"""Out of file descriptors is RESOURCE_EXHAUSTED, not INVALID_CHECKPOINT (issue 27,
item 11), in a real process whose descriptors are all in use.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support import Checkpoints
from weightcache.testing import child_env

pytestmark = pytest.mark.timeout(120)

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


def test_opening_a_checkpoint_without_descriptors_is_resource_exhausted(
    checkpoints: Checkpoints,
) -> None:
    run = subprocess.run(
        [
            "prlimit",
            "--nofile=256:256",
            "--",
            sys.executable,
            "-c",
            SCRIPT,
            str(checkpoints.sharded),
        ],
        check=False,
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=90,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.splitlines()[-1])
    assert got["reason"] == "RESOURCE_EXHAUSTED", got
    assert "Too many open files" in got["detail"], got
    assert str(checkpoints.sharded) in got["detail"] or "safetensors" in got["detail"], got

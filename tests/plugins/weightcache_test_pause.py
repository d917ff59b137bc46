"""A recipe plugin for the tests: ``pause`` holds a load before it reads any tensor.

Registered in the ``weightcache.recipes`` group by ``weightcache_test_pause-0.1.dist-info``
beside this file. Parameter ``dir``: a folder. Computing the first tensor (in the daemon's
load thread, after the checkpoint was validated and fingerprinted) first creates
``DIR/reached``, then waits for ``DIR/go`` (at most :data:`WAIT_SECONDS`) before reading.
A test changes the files in that window. The tensors are left as they are.

With ``at=plan`` it holds the same way while the recipe is planned instead (after the
headers were validated, before the fingerprint and any tensor), and leaves every node as
it is: each stays the stored tensor it was, so the disk path maps it
(:mod:`weightcache._disk`) as it maps a checkpoint without a recipe.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path

import torch

from weightcache import Node
from weightcache.core.pipeline import CheckpointReader

WAIT_SECONDS = 60.0


class Pause:
    """Hold the load at its first tensor until the test says go."""

    name = "pause"
    version = "0.1"

    def transform(self, nodes: dict[str, Node], params: Mapping[str, str]) -> dict[str, Node]:
        folder = Path(params["dir"])
        if params.get("at") == "plan":
            _hold(folder)
            return nodes
        first = next(iter(nodes))
        read = nodes[first].compute

        def paused(reader: CheckpointReader) -> torch.Tensor:
            _hold(folder)
            return read(reader)

        return {**nodes, first: Node(nodes[first].spec, paused)}


def _hold(folder: Path) -> None:
    """Create ``folder/reached``, then wait for ``folder/go``."""
    (folder / "reached").touch()
    deadline = time.monotonic() + WAIT_SECONDS
    while not (folder / "go").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{folder / 'go'} did not appear")
        time.sleep(0.01)

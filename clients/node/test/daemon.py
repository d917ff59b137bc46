"""A real weightcache daemon for the Node client's tests, with what Python reads.

Writes small checkpoints (``single``, ``sharded``: :func:`weightcache.testing.checkpoints.
reference_tensors`; ``alltypes``: one tensor of every supported dtype), starts
``weightcache preload`` on them (:func:`weightcache.testing.daemon.run_daemon`), and prints
one JSON line: the socket, the checkpoint folders, per checkpoint and tensor its dtype,
shape and the sha256 of its bytes as safetensors' Python reader gives them, and the Python
SDK's dtype table (safetensors name -> element size in bytes, from
:data:`weightcache.core.dtypes.TORCH_DTYPES`) for the Node one to match. Then it waits
until its stdin closes, stops the daemon and checks that it left no socket, lock file or
/dev/shm segment (exit status 1 and the reason on stderr otherwise).

    python clients/node/test/daemon.py
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

from weightcache.core.dtypes import TORCH_DTYPES
from weightcache.testing.checkpoints import make_checkpoints, raw_bytes, write_single
from weightcache.testing.daemon import HarnessError, run_daemon


def _every_dtype() -> dict[str, torch.Tensor]:
    """One (3, 5) tensor of random bytes per dtype, named by it (BOOL: 0 or 1 only)."""
    gen = torch.Generator().manual_seed(12)
    tensors = {}
    for name, dtype in sorted(TORCH_DTYPES.items()):
        if dtype == torch.bool:
            bits = torch.randint(0, 2, (15,), dtype=torch.uint8, generator=gen)
        else:
            bits = torch.randint(0, 256, (15 * dtype.itemsize,), generator=gen).to(torch.uint8)
        tensors[name.lower()] = bits.view(dtype).reshape(3, 5)
    return tensors


def _read_back(folder: Path) -> dict[str, dict[str, object]]:
    """Every tensor of a checkpoint as safetensors reads it: dtype name, shape, sha256."""
    names = {v: k for k, v in TORCH_DTYPES.items()}
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        tensors |= load_file(shard)
    return {
        name: {
            "dtype": names[t.dtype],
            "shape": list(t.shape),
            "sha256": hashlib.sha256(raw_bytes(t).numpy().tobytes()).hexdigest(),
        }
        for name, t in tensors.items()
    }


def main() -> int:
    root = Path(tempfile.mkdtemp(prefix="wc-node-"))
    try:
        made = make_checkpoints(root)
        folders = {
            "single": made.single,
            "sharded": made.sharded,
            "alltypes": write_single(root / "alltypes", _every_dtype()),
        }
        with run_daemon(list(folders.values())) as daemon:
            info = {
                "socket": daemon.socket,
                "checkpoints": {name: str(path) for name, path in folders.items()},
                "tensors": {name: _read_back(path) for name, path in folders.items()},
                "dtypes": {name: dtype.itemsize for name, dtype in TORCH_DTYPES.items()},
            }
            print(json.dumps(info), flush=True)
            sys.stdin.read()  # until the test closes our stdin
    except HarnessError as exc:
        print(f"daemon.py: {exc}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

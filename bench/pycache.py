"""Whether the processes a start-up benchmark spawns run from cached bytecode (issue 39).

Python compiles each module's source at its import unless a ``.pyc`` of it is cached:
beside the source (``__pycache__``, written by ``pip install``, ``uv pip install
--compile-bytecode`` or ``python -m compileall``, or by Python itself at a first import)
or under ``$PYTHONPYCACHEPREFIX``. ``uv pip install`` writes none by default, and
``PYTHONDONTWRITEBYTECODE=1`` keeps Python from writing any: then every process compiles
grpc, protobuf, structlog and weightcache again, which on the project's 2-CPU VM is about
half of a daemon's start (bench/README.md). An installed daemon (the Docker image: ``pip
install``) runs from bytecode.

``describe()`` says which case a run measures; ``use_cache(folder)`` makes every process
spawned afterwards read and write its bytecode under ``folder``, as an installed package
would (the first run of each module writes it: warm up before timing).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path


def installed_bytecode(module: str = "grpc") -> bool:
    """Whether ``module``'s package has its ``__init__`` compiled beside its source."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return False
    source = Path(spec.origin)
    return (
        source.parent / "__pycache__" / f"{source.stem}.{sys.implementation.cache_tag}.pyc"
    ).exists()


def describe() -> str:
    """One line: where the spawned processes find bytecode, if anywhere."""
    prefix = os.environ.get("PYTHONPYCACHEPREFIX")
    writes = not os.environ.get("PYTHONDONTWRITEBYTECODE")
    where = [f"cached under {prefix}"] if prefix and writes else []
    if installed_bytecode():
        where.append("installed beside the sources")
    if not where and writes:
        where.append("written by the first run")
    if not where:
        return "bytecode: none (none installed, PYTHONDONTWRITEBYTECODE): each process compiles"
    return "bytecode: " + ", ".join(where)


def use_cache(folder: Path) -> None:
    """Have every process spawned from now on cache its bytecode under ``folder``."""
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    os.environ["PYTHONPYCACHEPREFIX"] = str(folder)

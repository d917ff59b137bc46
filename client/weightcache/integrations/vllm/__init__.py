"""vLLM's load format ``weightcache``: vLLM gets a checkpoint's tensors from the daemon.

Installed with the package, as the entry point ``weightcache`` of vLLM's plugin group
``vllm.general_plugins``; vLLM calls :func:`register` in each of its processes, then::

    LLM(model=DIR, load_format="weightcache",
        model_loader_extra_config={"socket": "/run/weightcache/cpu.sock"})
    vllm serve DIR --load-format weightcache --model-loader-extra-config '{...}'

The keys of ``model_loader_extra_config`` are those of :mod:`.config`; the loader is
:class:`.loader.WeightcacheModelLoader`.
"""

from __future__ import annotations

#: The load format the plugin registers.
LOAD_FORMAT = "weightcache"

_registered = False


def register() -> None:
    """Register the load format ``weightcache`` with vLLM's model-loader registry.

    Idempotent: vLLM may call its general plugins more than once in one process (its own
    guard is per process, but a user may call this too), and registering twice would log
    vLLM's "already registered" warning.

    Raises:
        ImportError: vLLM is not installed.
    """
    global _registered  # noqa: PLW0603 - once per process, whoever calls first
    if _registered:
        return
    from vllm.model_executor.model_loader import register_model_loader

    from weightcache.integrations.vllm.loader import WeightcacheModelLoader

    register_model_loader(LOAD_FORMAT)(WeightcacheModelLoader)
    _registered = True

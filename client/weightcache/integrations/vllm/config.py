"""The loader's options: vLLM's ``model_loader_extra_config`` for load format ``weightcache``.

vLLM hands the loader that dict as given (``--model-loader-extra-config`` is JSON). The
keys, all optional:

- ``socket`` (str): the daemon's Unix socket; default: the CPU daemon's default socket
  (:func:`weightcache.default_socket`, which honours ``$WEIGHTCACHE_SOCKET``);
- ``dtype`` (str): the daemon's ``--dtype`` (``"BF16"``, ``"F16"``, ``"F32"``, ``"F64"``),
  when it casts at preload; default none: the checkpoint's dtypes, which vLLM casts to the
  model's dtype while loading, as its default loader does;
- ``fingerprint_level`` (``"full"``, ``"sampled"``, ``"layout"``): the daemon's
  ``--fingerprint-level``; default ``"full"``;
- ``fallback`` (bool): when the daemon cannot serve (one of
  ``weightcache.FallbackReason.CODES``), load with vLLM's default loader and log the reason
  code (default true), or raise (false);
- ``wait_timeout`` (seconds, >= 0): how long to wait for a daemon still loading the model
  (and, without ``fallback``, for the daemon's socket); default 0 with ``fallback`` (an
  engine starts now, from disk, rather than wait), :data:`WAIT_WITHOUT_FALLBACK` (300 s,
  as vLLM's ``ipc_cache`` waits for its daemon) without: an engine started just before
  its daemon waits for it. One wait per ``load_model``: its daemon paths share it;
- ``recipe`` (``"vllm"`` or ``"checkpoint"``): ``"vllm"`` (default) asks first for the
  model as the ``vllm`` recipe holds it (vLLM names, built on the meta device and
  installed zero-copy; ``docs/vllm.md``), then for the checkpoint's tensors;
  ``"checkpoint"`` asks only for the checkpoint's tensors;
- ``cpu_gemm`` (``"auto"``, ``"shared"`` or ``"repacked"``): on CPU, on the vLLM-named
  path, whether the unquantized linears run on the daemon's tensors as they are
  (``"shared"``: no copy per engine) or on vLLM's oneDNN-repacked private copies
  (``"repacked"``, as vLLM's default loader); default ``"auto"``: repacked, which
  decodes faster where vLLM repacks
  (:mod:`weightcache.integrations.vllm.cpu_gemm` says why, ``docs/vllm.md`` gives the
  measures).

An unknown key or a value of the wrong type is a ``ValueError`` naming it, raised when
vLLM builds the loader (before any weight is read).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from weightcache._options import LoadOptions
from weightcache.core.errors import RecipeError
from weightcache.core.fingerprint import DEFAULT_LEVEL, LEVELS, Level
from weightcache.core.recipe import Recipe, parse_dtype
from weightcache.integrations.vllm import cpu_gemm

#: Every key of ``model_loader_extra_config`` the loader reads.
KEYS = (
    "socket",
    "dtype",
    "fingerprint_level",
    "fallback",
    "wait_timeout",
    "recipe",
    "cpu_gemm",
)
#: The default ``wait_timeout`` without ``fallback``, in seconds: vLLM's ``ipc_cache``
#: waits as long for its daemon (``state_timeout_s``).
WAIT_WITHOUT_FALLBACK = 300.0
#: What the engine asks the daemon for, in this order (``recipe``).
RECIPES = ("vllm", "checkpoint")


@dataclass(frozen=True, kw_only=True)
class VllmLoaderConfig:
    """The parsed ``model_loader_extra_config`` (the module docstring gives each key)."""

    socket: str | None = None
    dtype: str | None = None
    fingerprint_level: Level = DEFAULT_LEVEL
    fallback: bool = True
    wait_timeout: float = 0.0
    recipe: str = "vllm"
    cpu_gemm: str = cpu_gemm.DEFAULT

    @classmethod
    def parse(cls, extra: Mapping[str, Any] | None) -> VllmLoaderConfig:
        """Read vLLM's ``model_loader_extra_config``.

        Raises:
            ValueError: ``extra`` is not a dict, a key is not one of :data:`KEYS`, or a
                value has the wrong type or is out of range (the message names the key).
        """
        if extra is None:
            return cls()
        if not isinstance(extra, Mapping):
            raise ValueError(
                f"model_loader_extra_config must be a dict for load format weightcache, "
                f"not {type(extra).__name__}"
            )
        unknown = sorted(set(extra) - set(KEYS))
        if unknown:
            raise ValueError(
                f"unknown model_loader_extra_config key(s) for load format weightcache: "
                f"{', '.join(map(repr, unknown))}; known: {', '.join(KEYS)}"
            )
        fallback = _bool(extra, "fallback", default=True)
        default_wait = 0.0 if fallback else WAIT_WITHOUT_FALLBACK
        recipe = extra.get("recipe", "vllm")
        if recipe not in RECIPES:
            raise ValueError(
                f"model_loader_extra_config['recipe'] must be one of {RECIPES}, not {recipe!r}"
            )
        gemm = extra.get("cpu_gemm", cpu_gemm.DEFAULT)
        if gemm not in cpu_gemm.MODES:
            raise ValueError(
                f"model_loader_extra_config['cpu_gemm'] must be one of {cpu_gemm.MODES}, "
                f"not {gemm!r}"
            )
        return cls(
            socket=_optional_str(extra, "socket"),
            dtype=_dtype(extra),
            fingerprint_level=_level(extra),
            fallback=fallback,
            wait_timeout=_seconds(extra, "wait_timeout", default_wait),
            recipe=recipe,
            cpu_gemm=gemm,
        )

    def vllm_options(self, recipe: Recipe, tp_rank: int, tp_size: int) -> LoadOptions:
        """The options of :func:`weightcache.load` for the model the ``vllm`` recipe holds
        for this rank (``recipe`` as :func:`weightcache.integrations.vllm.loader.engine_recipe`
        makes it). Without weightcache's disk fallback, as :meth:`load_options`."""
        return LoadOptions(
            socket=self.socket,
            recipe=recipe,
            fingerprint_level=self.fingerprint_level,
            fallback=False,
            wait_timeout=self.wait_timeout,
            tp_rank=tp_rank,
            tp_size=tp_size,
        )

    def load_options(self) -> LoadOptions:
        """The options of :func:`weightcache.load` for this engine.

        The loader asks without weightcache's own disk fallback (``fallback=False``): a
        refusal comes back as an exception, and vLLM's default loader reads the disk.
        Whatever vLLM's ``tensor_parallel_size``, every rank gets the full tensors
        (placement 0 of 1): vLLM's weight loaders shard checkpoint tensors themselves, and
        would shard a shard again.
        """
        return LoadOptions(
            socket=self.socket,
            dtype=self.dtype,
            fingerprint_level=self.fingerprint_level,
            fallback=False,
            wait_timeout=self.wait_timeout,
        )


def _optional_str(extra: Mapping[str, Any], key: str) -> str | None:
    value = extra.get(key)
    if value is not None and not (isinstance(value, str) and value):
        raise ValueError(f"model_loader_extra_config[{key!r}] must be a non-empty string")
    return value


def _dtype(extra: Mapping[str, Any]) -> str | None:
    value = _optional_str(extra, "dtype")
    try:
        return parse_dtype(value)
    except RecipeError as err:
        raise ValueError(f"model_loader_extra_config['dtype']: {err}") from None


def _level(extra: Mapping[str, Any]) -> Level:
    value = extra.get("fingerprint_level", DEFAULT_LEVEL)
    for level in LEVELS:  # narrows the str to the Literal
        if value == level:
            return level
    raise ValueError(
        f"model_loader_extra_config['fingerprint_level'] must be one of {LEVELS}, not {value!r}"
    )


def _bool(extra: Mapping[str, Any], key: str, *, default: bool) -> bool:
    value = extra.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"model_loader_extra_config[{key!r}] must be true or false")
    return value


def _seconds(extra: Mapping[str, Any], key: str, default: float) -> float:
    value = extra.get(key, default)
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not (number and math.isfinite(value) and value >= 0):
        raise ValueError(f"model_loader_extra_config[{key!r}] must be a number of seconds >= 0")
    return float(value)

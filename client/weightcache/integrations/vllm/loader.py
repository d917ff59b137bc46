"""``WeightcacheModelLoader``: vLLM's model loader for load format ``weightcache``.

vLLM's ``BaseModelLoader.load_model`` builds the model, calls :meth:`load_weights`, then
runs ``process_weights_after_loading`` (repacking, quantization). This loader feeds the
model the checkpoint's tensors as the daemon holds them, zero-copy views of its shared
memory, through the model's own ``load_weights``: the same names and bytes vLLM's default
loader reads from the safetensors files, so the engine ends with the same parameters.

On CPU the daemon holds checkpoint tensors, not processed parameters: after processing, a
CPU linear layer's weight lives inside a oneDNN handle, which no other process can map.
Processing still runs in the engine (``docs/vllm.md`` has the GPU design).

When the daemon cannot serve (a code of ``weightcache.FallbackReason.CODES``), the loader
logs the code and loads with vLLM's ``DefaultModelLoader`` (``fallback``, the default), or
raises (``"fallback": false``).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol, cast

import torch
from torch import nn
from vllm.config import ModelConfig
from vllm.config.load import LoadConfig
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.logger import init_logger
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
from vllm.model_executor.model_loader.weight_utils import download_weights_from_hf

# Imported here, when vLLM loads the plugin, not inside the first load (weightcache's names
# import lazily): gRPC and the stubs are then ready before the weights are timed.
from weightcache import FallbackReason, load
from weightcache.core.errors import WeightCacheError
from weightcache.integrations.vllm.config import VllmLoaderConfig

# Under vLLM's logger, so that its handler and format show these lines beside its own.
logger = init_logger("vllm.plugins.weightcache")


class _VllmModel(Protocol):
    """What vLLM's models provide: ``load_weights`` takes (checkpoint name, tensor) pairs
    and returns the names of the parameters it loaded (None when it does not track)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[str] | None:
        """Copy the pairs into the model's parameters."""


#: What a model folder given as a Hugging Face repository id is downloaded with.
_HUB_PATTERNS = ["*.safetensors", "*.json"]


class WeightcacheModelLoader(BaseModelLoader):
    """Loads a model's weights from the weightcache daemon, or with vLLM's default loader.

    Args:
        load_config: vLLM's ``LoadConfig``; its ``model_loader_extra_config`` holds the
            options of :mod:`weightcache.integrations.vllm.config`.

    Raises:
        ValueError: ``model_loader_extra_config`` has an unknown key or a bad value.
    """

    def __init__(self, load_config: LoadConfig) -> None:
        super().__init__(load_config)
        self.config = VllmLoaderConfig.parse(load_config.model_loader_extra_config)

    def download_model(self, model_config: ModelConfig) -> None:
        """Download the checkpoint as vLLM's default loader would (a repository id), so
        that a disk fallback finds it too; a local folder is left as is."""
        self._default_loader().download_model(model_config)

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        """Load the checkpoint's tensors into ``model`` (built by vLLM, not yet processed).

        Raises:
            weightcache.WeightCacheError: with ``"fallback": false``, the daemon cannot
                serve (the subclass names the reason); with any ``fallback``, it refused
                for a reason a disk load would hide (``PermissionDeniedError``, ...).
            weightcache.InvalidCheckpointError: the checkpoint is malformed.
            ValueError: a parameter of ``model`` got no tensor from the checkpoint.
        """
        unsupported = _other_weight_sources(model)
        if unsupported:
            logger.warning(
                "weightcache: %s reads weights the checkpoint folder's safetensors do not "
                "hold (%s); loading with vLLM's default loader",
                type(model).__name__,
                unsupported,
            )
            self._default_loader().load_weights(model, model_config)
            return
        folder = self._model_folder(model_config)
        tp_size = get_tensor_model_parallel_world_size()
        if tp_size > 1:
            logger.info(
                "weightcache: tensor_parallel_size %d: every rank attaches the full tensors, "
                "which vLLM's weight loaders shard (a daemon placement would be sharded twice)",
                tp_size,
            )
        start = time.perf_counter()
        try:
            weights = load(folder, options=self.config.load_options())
        except WeightCacheError as err:
            if not self.config.fallback or err.reason not in FallbackReason.CODES:
                raise
            logger.warning(
                "weightcache: falling back to vLLM's default loader: reason=%s detail=%s",
                err.reason,
                err.detail,
            )
            self._default_loader().load_weights(model, model_config)
            return
        attached = time.perf_counter()
        with weights:
            loaded = cast(_VllmModel, model).load_weights(iter(weights.tensors.items()))
            nbytes = sum(t.nbytes for t in weights.tensors.values())
            logger.info(
                "weightcache: attached %d tensors (%.1f MB) of model %r from the daemon at "
                "%s in %.3f s, then vLLM's weight loaders copied them in %.3f s: source=%s",
                len(weights.tensors),
                nbytes / 1e6,
                weights.model,
                weights.socket,
                attached - start,
                time.perf_counter() - attached,
                weights.source,
            )
        # vLLM's weight loaders copy into the model's own parameters, so the lease ends
        # once they are done (``with``); a view a loader kept would stay readable anyway:
        # on CPU a mapping outlives its lease (copy-on-write, see weightcache._lease).
        if loaded is not None and model_config.quantization is None:
            self._default_loader().track_weights_loading(model, set(loaded))

    def _model_folder(self, model_config: ModelConfig) -> Path:
        if os.path.isdir(model_config.model):
            return Path(model_config.model)
        return Path(
            download_weights_from_hf(
                model_config.model,
                self.load_config.download_dir,
                _HUB_PATTERNS,
                model_config.revision,
                ignore_patterns=self.load_config.ignore_patterns,
            )
        )

    def _default_loader(self) -> DefaultModelLoader:
        # The user's LoadConfig, read as load format "auto" with none of this loader's keys
        # (the default loader refuses keys it does not know).
        config = dataclasses.replace(
            self.load_config, load_format="auto", model_loader_extra_config={}
        )
        return DefaultModelLoader(config)


def _other_weight_sources(model: nn.Module) -> str:
    """What makes vLLM's default loader read more than the folder's safetensors for this
    model (a second source, its own file patterns); empty when nothing does."""
    found = []
    if getattr(model, "secondary_weights", ()):
        found.append("secondary_weights")
    if getattr(model, "allow_patterns_overrides", None) is not None:
        found.append("allow_patterns_overrides")
    return ", ".join(found)

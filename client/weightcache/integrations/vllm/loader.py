"""``WeightcacheModelLoader``: vLLM's model loader for load format ``weightcache``.

Two paths, tried in this order (``docs/vllm.md``):

1. **vLLM-named** (:meth:`WeightcacheModelLoader.load_model`, ``"recipe": "vllm"``, the
   default): the engine asks the daemon for the model as the ``vllm`` recipe holds it
   (:mod:`.recipe`: vLLM's names, fused and loaded by vLLM, for this rank, dtype,
   quantization and vLLM version), builds its model on the meta device, installs each held
   tensor as the parameter or buffer of its name, zero-copy (:mod:`.install`), and runs
   ``process_weights_after_loading``. The lease is kept as long as the model lives.
2. **checkpoint tensors** (:meth:`WeightcacheModelLoader.load_weights`): vLLM builds the
   model and this loader feeds its ``load_weights`` the checkpoint's tensors as the daemon
   holds them (zero-copy views), which vLLM's weight loaders copy, fuse and shard.

When the daemon cannot serve a path (a code of ``weightcache.FallbackReason.CODES``, or a
recipe this engine cannot ask for), the loader logs the code and goes on to the next path,
then to vLLM's ``DefaultModelLoader`` (``fallback``, the default), or raises once no
daemon path is left (``"fallback": false``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Protocol, cast

import torch
from torch import nn
from vllm.config import ModelConfig, VllmConfig
from vllm.config.load import LoadConfig
from vllm.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from vllm.logger import init_logger
from vllm.model_executor.layers import rotary_embedding
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
from vllm.model_executor.model_loader.utils import (
    initialize_model,
    process_weights_after_loading,
)
from vllm.model_executor.model_loader.weight_utils import download_weights_from_hf
from vllm.utils.torch_utils import set_default_torch_dtype

# Imported here, when vLLM loads the plugin, not inside the first load (weightcache's names
# import lazily): gRPC and the stubs are then ready before the weights are timed.
from weightcache import FallbackReason, LoadedWeights, LoadOptions, load
from weightcache.core import hub, rpc
from weightcache.core.errors import (
    FingerprintMismatchError,
    InvalidCheckpointError,
    RecipeError,
    WeightCacheError,
)
from weightcache.core.plugins import PluginStep
from weightcache.core.recipe import Placement, Recipe
from weightcache.core.sockets import default_socket
from weightcache.integrations.vllm import cpu_gemm
from weightcache.integrations.vllm.config import VllmLoaderConfig
from weightcache.integrations.vllm.install import InstallError, install
from weightcache.integrations.vllm.recipe import (
    PLUGIN_NAME,
    canonical_dtype,
    canonical_overrides,
    differing_fields,
)
from weightcache.v1 import weight_cache_service_pb2 as pb

# Under vLLM's logger, so that its handler and format show these lines beside its own.
logger = init_logger("vllm.plugins.weightcache")


class _VllmModel(Protocol):
    """What vLLM's models provide: ``load_weights`` takes (checkpoint name, tensor) pairs
    and returns the names of the parameters it loaded (None when it does not track)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[str] | None:
        """Copy the pairs into the model's parameters."""


#: The log line of a fallback to vLLM's default loader (the reason code follows).
FALLBACK_LINE = "weightcache: falling back to vLLM's default loader: reason="
#: What a model folder given as a Hugging Face repository id is downloaded with.
_HUB_PATTERNS = ["*.safetensors", "*.json"]
#: The log line of the vLLM-named path's success, and of its refusal (then the next path).
INSTALLED_LINE = "weightcache: installed "
SKIPPED_LINE = "weightcache: no vLLM-named model, using the checkpoint's tensors: reason="
#: The log line of ``cpu_gemm`` ``"shared"``: how many linears run on the daemon's tensors.
SHARED_LINE = "weightcache: cpu_gemm=shared: on the daemon's tensors, torch.nn.functional.linear, "
#: The attribute of a model installed from the daemon that keeps its weights' lease.
WEIGHTS_ATTRIBUTE = "_weightcache_weights"
#: Seconds the daemon has to describe a held model that differs (GetModel).
DESCRIBE_TIMEOUT = 5.0


def engine_recipe(model_config: ModelConfig) -> Recipe:
    """The ``vllm`` recipe an engine of ``model_config`` asks the daemon for: its dtype,
    quantization, ``hf_overrides`` (what it changes in ``config.json``) and
    ``max_model_len`` (which the recipe keeps only where a buffer depends on it); the rest
    (architecture, config digest, versions, placement) the recipe resolves.

    Raises:
        RecipeError: ``hf_overrides`` is a function (vLLM accepts one), which no identity
            can name, or an object JSON cannot write.
    """
    params = (
        ("dtype", canonical_dtype(model_config.dtype)),
        ("hf_overrides", canonical_overrides(model_config.hf_overrides)),
        ("max_model_len", str(model_config.max_model_len)),
        ("quantization", str(model_config.quantization or "none").lower()),
    )
    return Recipe(plugins=(PluginStep(PLUGIN_NAME, params),))


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
        self._daemon_down = False
        #: When the wait of the load in progress ends (``time.monotonic()``); set by
        #: :meth:`load_model`, None for a ``load_weights`` called on its own.
        self._deadline: float | None = None

    def load_model(
        self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = ""
    ) -> nn.Module:
        """The model on the daemon's vLLM-named tensors, else vLLM's own build through
        :meth:`load_weights` (checkpoint tensors, then the default loader).

        Raises:
            weightcache.WeightCacheError: with ``"fallback": false``, no daemon path can
                serve (the subclass names the reason of the last); a refusal a disk load
                would hide (``PermissionDeniedError``, ...), with any ``fallback``.
        """
        self._daemon_down = False
        # One wait for the whole load: the paths share wait_timeout, never each its own.
        self._deadline = time.monotonic() + self.config.wait_timeout
        try:
            if self.config.recipe == "vllm":
                model = self._load_vllm_named(vllm_config, model_config, prefix)
                if model is not None:
                    return model
            return cast(nn.Module, super().load_model(vllm_config, model_config, prefix))
        finally:
            self._deadline = None

    def _load_vllm_named(
        self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str
    ) -> nn.Module | None:
        folder = self._model_folder(model_config)
        start = time.perf_counter()
        options: LoadOptions | None = None
        try:
            options = self.config.vllm_options(
                engine_recipe(model_config),
                get_tensor_model_parallel_rank(),
                get_tensor_model_parallel_world_size(),
            )
            weights = load(folder, options=self._waiting(options))
        except RecipeError as err:
            # A recipe this engine cannot ask for (a placement it does not build, an
            # hf_overrides function): the checkpoint tensors are the next daemon path,
            # with "fallback": false too (docs/vllm.md, "Tensor parallelism").
            self._skip(err.reason, err.detail)
            return None
        except InvalidCheckpointError as err:
            # A folder without safetensors (.bin only), which vLLM's own loaders still read.
            if not self.config.fallback:
                raise
            self._skip(err.reason, err.detail)
            return None
        except WeightCacheError as err:
            if err.reason not in FallbackReason.CODES:
                raise
            self._daemon_down = err.reason == "DAEMON_UNAVAILABLE"
            if self._daemon_down and not self.config.fallback:
                raise
            detail = err.detail
            if isinstance(err, FingerprintMismatchError) and options is not None:
                detail += _differing_fields(err, folder, options)
            self._skip(err.reason, detail)
            return None
        attached = time.perf_counter()
        try:
            with _registrations_undone_on_failure(vllm_config):
                model = self._build_on(weights, vllm_config, model_config, prefix)
        except InstallError as err:
            weights.close()
            if not self.config.fallback:
                raise
            self._skip("INSTALL_FAILED", str(err))
            return None
        logger.info(
            "%s%d tensors (%.1f MB) of model %r from the daemon at %s zero-copy: attached "
            "in %.3f s, model built on meta, installed and processed in %.3f s",
            INSTALLED_LINE,
            len(weights.tensors),
            sum(t.nbytes for t in weights.tensors.values()) / 1e6,
            weights.model,
            weights.socket,
            attached - start,
            time.perf_counter() - attached,
        )
        return model

    def _build_on(
        self,
        weights: LoadedWeights,
        vllm_config: VllmConfig,
        model_config: ModelConfig,
        prefix: str,
    ) -> nn.Module:
        """Build the model on meta, install ``weights``, process; the model keeps them."""
        device = torch.device(self.load_config.device or vllm_config.device_config.device or "cpu")
        with set_default_torch_dtype(model_config.dtype):
            with torch.device("meta"):
                model = initialize_model(
                    vllm_config=vllm_config, model_config=model_config, prefix=prefix
                )
            # Refuses a model with a tensor the daemon does not hold (the caller falls back),
            # rather than give it uninitialized memory as vLLM's IpcModelLoader does.
            installed = install(model, weights.tensors)
            with cpu_gemm.processing(self.config.cpu_gemm, model_config.dtype) as shared:
                process_weights_after_loading(model, model_config, device)
        if shared:
            logger.info(
                "%s%d linears: %s", SHARED_LINE, len(shared), ", ".join(sorted(set(shared)))
            )
        # The lease (and, on a GPU, the daemon's memory) must last as long as the model.
        object.__setattr__(model, WEIGHTS_ATTRIBUTE, weights)
        logger.debug(
            "weightcache: installed %d tensors under %d names", installed.tensors, installed.names
        )
        return cast(nn.Module, model.eval())

    def _waiting(self, options: LoadOptions) -> LoadOptions:
        """``options`` with the wait left of this load (``wait_timeout`` less what the
        paths before waited): a load waits ``wait_timeout`` once, not once per path."""
        if self._deadline is None:
            return options
        left = max(0.0, self._deadline - time.monotonic())
        return dataclasses.replace(options, wait_timeout=min(options.wait_timeout, left))

    @staticmethod
    def _skip(reason: str, detail: str) -> None:
        logger.warning("%s%s detail=%s", SKIPPED_LINE, reason, detail)

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
        if self._daemon_down:
            # The vLLM-named path found no daemon just now: asking again would only wait.
            logger.warning("%sDAEMON_UNAVAILABLE detail=as for the vLLM-named model", FALLBACK_LINE)
            self._default_loader().load_weights(model, model_config)
            return
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
            weights = load(folder, options=self._waiting(self.config.load_options()))
        except WeightCacheError as err:
            # A folder without safetensors (.bin only) is no checkpoint for weightcache,
            # but vLLM's default loader reads it.
            readable = err.reason in FallbackReason.CODES or isinstance(err, InvalidCheckpointError)
            if not self.config.fallback or not readable:
                raise
            logger.warning("%s%s detail=%s", FALLBACK_LINE, err.reason, err.detail)
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
        if self.load_config.download_dir is None:
            # A repo id already in the local Hub cache: the snapshot the daemon finds for
            # it (weightcache.core.hub), read offline; else vLLM's own download.
            with contextlib.suppress(InvalidCheckpointError):
                return Path(hub.resolve_model(model_config.model, model_config.revision))
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


@contextlib.contextmanager
def _registrations_undone_on_failure(vllm_config: VllmConfig) -> Iterator[None]:
    """Undo, when the body raises, what building a model registers outside it: its
    attention (and other stateful) layers by name in the compilation config's
    ``static_forward_context`` (vLLM refuses a second layer of the same name, "Duplicate
    layer name"), its MoE layers in ``static_all_moe_layers``, and the rotary modules
    vLLM's ``get_rope`` keeps for reuse (``_ROPE_DICT``: built on meta, a later build
    would reuse them, buffers without values). So a model built on meta and refused can
    be built again, on its device, by the next path."""
    compilation = vllm_config.compilation_config
    context = dict(compilation.static_forward_context)
    moe_layers = list(compilation.static_all_moe_layers)
    ropes = dict(rotary_embedding._ROPE_DICT)
    try:
        yield
    except BaseException:
        compilation.static_forward_context.clear()
        compilation.static_forward_context.update(context)
        compilation.static_all_moe_layers[:] = moe_layers
        rotary_embedding._ROPE_DICT.clear()
        rotary_embedding._ROPE_DICT.update(ropes)
        raise


def _differing_fields(err: FingerprintMismatchError, folder: Path, options: LoadOptions) -> str:
    """``"; the daemon's vllm step differs in F, G"``: the fields of the ``vllm`` step in
    which the held model the daemon named differs from the one asked for (an override by
    its key, ``hf_overrides.rope_scaling``), from the daemon's GetModel; ``""`` when the
    recipe does not differ or the daemon cannot say (a diagnostic: never a refusal)."""
    name = err.metadata.get("model", "")
    if "recipe" not in err.components or not name or options.recipe is None:
        return ""
    try:
        socket = options.socket or default_socket(options.device)
        reply = rpc.call_shared(
            socket,
            lambda stub: stub.GetModel(pb.GetModelRequest(name=name), timeout=DESCRIBE_TIMEOUT),
        )
        placement = Placement(options.tp_rank, options.tp_size)
        asked = options.recipe.identity(folder, placement)["plugins"][0]
    except (WeightCacheError, ValueError):
        return ""
    held = [step for step in reply.model.recipe.plugins if step.name == PLUGIN_NAME]
    if not held:
        return f"; the daemon's model {name!r} is not held through the {PLUGIN_NAME} recipe"
    fields = differing_fields(
        dict(asked["params"]), dict(held[0].params), asked["version"], held[0].version
    )
    return f"; the daemon's {PLUGIN_NAME} step differs in {', '.join(fields)}" if fields else ""


def _other_weight_sources(model: nn.Module) -> str:
    """What makes vLLM's default loader read more than the folder's safetensors for this
    model (a second source, its own file patterns); empty when nothing does."""
    found = []
    if getattr(model, "secondary_weights", ()):
        found.append("secondary_weights")
    if getattr(model, "allow_patterns_overrides", None) is not None:
        found.append("allow_patterns_overrides")
    return ", ".join(found)

"""weightcache: get a checkpoint's weights from the local weight-cache daemon, or from disk.

>>> import weightcache
>>> with weightcache.load("/models/llama") as weights:   # doctest: +SKIP
...     weights.source, weights.fallback_reason
"""

import importlib as _importlib
import os as _os
import typing as _typing

# gRPC's fork support (its at-fork handlers, which quiesce its threads and reset its
# poller), read once when grpc is first imported: a worker forked after using the SDK
# then connects afresh (weightcache.core.forking). The daemon, an asyncio server that
# never forks, turns it off in weightcache_service/__init__.py first.
_os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "1")

# Registers the SDK's at-fork handlers now, before grpc (imported later) registers its
# own: in a child, ours must run first (weightcache.core.forking.abandon_channels).
import weightcache.core.forking as _forking  # noqa: F401

if _typing.TYPE_CHECKING:
    from weightcache._lease import EXIT_LEASE_LOST, ClientLease
    from weightcache._loader import FallbackReason, LoadedWeights, load, load_from_disk
    from weightcache._module import load_into
    from weightcache._options import LoadKeywords, LoadOptions
    from weightcache.core.checkpoint import (
        Checkpoint,
        FileIdentity,
        ShardInfo,
        TensorInfo,
        hub_snapshot,
        open_checkpoint,
    )
    from weightcache.core.contract import proto_path
    from weightcache.core.errors import (
        CudaError,
        DaemonUnavailableError,
        DeviceNotVisibleError,
        DrainingError,
        FingerprintMismatchError,
        HandleError,
        InternalError,
        InvalidArgumentError,
        InvalidCheckpointError,
        LeaseLostError,
        LeaseNotFoundError,
        LeasesActiveError,
        MissingTensorError,
        ModelExistsError,
        ModelFailedError,
        ModelLoadingError,
        ModelNotFoundError,
        NotSameHostError,
        PermissionDeniedError,
        RecipeError,
        RemoteError,
        ResourceExhaustedError,
        UnauthenticatedError,
        UntrustedSocketError,
        WeightCacheError,
    )
    from weightcache.core.fingerprint import Fingerprint, compute_fingerprint
    from weightcache.core.pipeline import CheckpointReader, Node, TensorSpec
    from weightcache.core.plugins import ENTRY_POINT_GROUP, ModelPlugin, PluginStep, RecipePlugin
    from weightcache.core.recipe import Pipeline, Placement, Recipe
    from weightcache.core.sockets import default_socket
    from weightcache.core.tp import TPPlan
    from weightcache.core.version import PROTOCOL_VERSION, __version__

# Attributes are imported on first use (PEP 562) so that `import weightcache` and the
# `weightcache health` probe do not pay for importing torch.
_SOURCES = {
    "Checkpoint": "weightcache.core.checkpoint",
    "FileIdentity": "weightcache.core.checkpoint",
    "ShardInfo": "weightcache.core.checkpoint",
    "TensorInfo": "weightcache.core.checkpoint",
    "hub_snapshot": "weightcache.core.checkpoint",
    "open_checkpoint": "weightcache.core.checkpoint",
    "proto_path": "weightcache.core.contract",
    "CudaError": "weightcache.core.errors",
    "DaemonUnavailableError": "weightcache.core.errors",
    "DeviceNotVisibleError": "weightcache.core.errors",
    "DrainingError": "weightcache.core.errors",
    "FingerprintMismatchError": "weightcache.core.errors",
    "HandleError": "weightcache.core.errors",
    "InternalError": "weightcache.core.errors",
    "InvalidArgumentError": "weightcache.core.errors",
    "InvalidCheckpointError": "weightcache.core.errors",
    "LeaseLostError": "weightcache.core.errors",
    "LeaseNotFoundError": "weightcache.core.errors",
    "LeasesActiveError": "weightcache.core.errors",
    "MissingTensorError": "weightcache.core.errors",
    "ModelExistsError": "weightcache.core.errors",
    "ModelFailedError": "weightcache.core.errors",
    "ModelLoadingError": "weightcache.core.errors",
    "ModelNotFoundError": "weightcache.core.errors",
    "NotSameHostError": "weightcache.core.errors",
    "PermissionDeniedError": "weightcache.core.errors",
    "RecipeError": "weightcache.core.errors",
    "RemoteError": "weightcache.core.errors",
    "ResourceExhaustedError": "weightcache.core.errors",
    "UnauthenticatedError": "weightcache.core.errors",
    "UntrustedSocketError": "weightcache.core.errors",
    "WeightCacheError": "weightcache.core.errors",
    "Fingerprint": "weightcache.core.fingerprint",
    "compute_fingerprint": "weightcache.core.fingerprint",
    "EXIT_LEASE_LOST": "weightcache._lease",
    "ClientLease": "weightcache._lease",
    "FallbackReason": "weightcache._loader",
    "LoadedWeights": "weightcache._loader",
    "load": "weightcache._loader",
    "load_from_disk": "weightcache._loader",
    "load_into": "weightcache._module",
    "LoadKeywords": "weightcache._options",
    "LoadOptions": "weightcache._options",
    "CheckpointReader": "weightcache.core.pipeline",
    "Node": "weightcache.core.pipeline",
    "TensorSpec": "weightcache.core.pipeline",
    "ENTRY_POINT_GROUP": "weightcache.core.plugins",
    "ModelPlugin": "weightcache.core.plugins",
    "PluginStep": "weightcache.core.plugins",
    "RecipePlugin": "weightcache.core.plugins",
    "Pipeline": "weightcache.core.recipe",
    "Placement": "weightcache.core.recipe",
    "Recipe": "weightcache.core.recipe",
    "default_socket": "weightcache.core.sockets",
    "TPPlan": "weightcache.core.tp",
    "PROTOCOL_VERSION": "weightcache.core.version",
    "__version__": "weightcache.core.version",
}

__all__ = [
    "ENTRY_POINT_GROUP",
    "EXIT_LEASE_LOST",
    "PROTOCOL_VERSION",
    "Checkpoint",
    "CheckpointReader",
    "ClientLease",
    "CudaError",
    "DaemonUnavailableError",
    "DeviceNotVisibleError",
    "DrainingError",
    "FallbackReason",
    "FileIdentity",
    "Fingerprint",
    "FingerprintMismatchError",
    "HandleError",
    "InternalError",
    "InvalidArgumentError",
    "InvalidCheckpointError",
    "LeaseLostError",
    "LeaseNotFoundError",
    "LeasesActiveError",
    "LoadKeywords",
    "LoadOptions",
    "LoadedWeights",
    "MissingTensorError",
    "ModelExistsError",
    "ModelFailedError",
    "ModelLoadingError",
    "ModelNotFoundError",
    "ModelPlugin",
    "Node",
    "NotSameHostError",
    "PermissionDeniedError",
    "Pipeline",
    "Placement",
    "PluginStep",
    "Recipe",
    "RecipeError",
    "RecipePlugin",
    "RemoteError",
    "ResourceExhaustedError",
    "ShardInfo",
    "TPPlan",
    "TensorInfo",
    "TensorSpec",
    "UnauthenticatedError",
    "UntrustedSocketError",
    "WeightCacheError",
    "__version__",
    "compute_fingerprint",
    "default_socket",
    "hub_snapshot",
    "load",
    "load_from_disk",
    "load_into",
    "open_checkpoint",
    "proto_path",
]


def __getattr__(name: str) -> _typing.Any:
    module = _SOURCES.get(name)
    if module is None:
        raise AttributeError(f"module 'weightcache' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)

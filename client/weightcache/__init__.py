"""weightcache: get a checkpoint's weights from the local weight-cache daemon, or from disk.

>>> import weightcache
>>> with weightcache.load("/models/llama") as weights:   # doctest: +SKIP
...     weights.source, weights.fallback_reason
"""

import importlib as _importlib
import typing as _typing

if _typing.TYPE_CHECKING:
    from weightcache._checkpoint import (
        Checkpoint,
        ShardInfo,
        TensorInfo,
        hub_snapshot,
        open_checkpoint,
    )
    from weightcache._errors import (
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
    from weightcache._fingerprint import Fingerprint, compute_fingerprint
    from weightcache._lease import EXIT_LEASE_LOST
    from weightcache._loader import FallbackReason, LoadedWeights, load, load_from_disk
    from weightcache._module import load_into
    from weightcache._pipeline import Node, TensorSpec
    from weightcache._plugins import ENTRY_POINT_GROUP, PluginStep, RecipePlugin
    from weightcache._recipe import Placement, Recipe
    from weightcache._rpc import default_socket
    from weightcache._tp import TPPlan
    from weightcache._version import PROTOCOL_VERSION, __version__

# Attributes are imported on first use (PEP 562) so that `import weightcache` and the
# `weightcache health` probe do not pay for importing torch.
_SOURCES = {
    "Checkpoint": "weightcache._checkpoint",
    "ShardInfo": "weightcache._checkpoint",
    "TensorInfo": "weightcache._checkpoint",
    "hub_snapshot": "weightcache._checkpoint",
    "open_checkpoint": "weightcache._checkpoint",
    "CudaError": "weightcache._errors",
    "DaemonUnavailableError": "weightcache._errors",
    "DeviceNotVisibleError": "weightcache._errors",
    "DrainingError": "weightcache._errors",
    "FingerprintMismatchError": "weightcache._errors",
    "HandleError": "weightcache._errors",
    "InternalError": "weightcache._errors",
    "InvalidArgumentError": "weightcache._errors",
    "InvalidCheckpointError": "weightcache._errors",
    "LeaseLostError": "weightcache._errors",
    "LeaseNotFoundError": "weightcache._errors",
    "LeasesActiveError": "weightcache._errors",
    "ModelExistsError": "weightcache._errors",
    "ModelFailedError": "weightcache._errors",
    "ModelLoadingError": "weightcache._errors",
    "ModelNotFoundError": "weightcache._errors",
    "NotSameHostError": "weightcache._errors",
    "PermissionDeniedError": "weightcache._errors",
    "RecipeError": "weightcache._errors",
    "RemoteError": "weightcache._errors",
    "ResourceExhaustedError": "weightcache._errors",
    "UnauthenticatedError": "weightcache._errors",
    "UntrustedSocketError": "weightcache._errors",
    "WeightCacheError": "weightcache._errors",
    "Fingerprint": "weightcache._fingerprint",
    "compute_fingerprint": "weightcache._fingerprint",
    "EXIT_LEASE_LOST": "weightcache._lease",
    "FallbackReason": "weightcache._loader",
    "LoadedWeights": "weightcache._loader",
    "load": "weightcache._loader",
    "load_from_disk": "weightcache._loader",
    "load_into": "weightcache._module",
    "Node": "weightcache._pipeline",
    "TensorSpec": "weightcache._pipeline",
    "ENTRY_POINT_GROUP": "weightcache._plugins",
    "PluginStep": "weightcache._plugins",
    "RecipePlugin": "weightcache._plugins",
    "Placement": "weightcache._recipe",
    "Recipe": "weightcache._recipe",
    "default_socket": "weightcache._rpc",
    "TPPlan": "weightcache._tp",
    "PROTOCOL_VERSION": "weightcache._version",
    "__version__": "weightcache._version",
}

__all__ = [
    "ENTRY_POINT_GROUP",
    "EXIT_LEASE_LOST",
    "PROTOCOL_VERSION",
    "Checkpoint",
    "CudaError",
    "DaemonUnavailableError",
    "DeviceNotVisibleError",
    "DrainingError",
    "FallbackReason",
    "Fingerprint",
    "FingerprintMismatchError",
    "HandleError",
    "InternalError",
    "InvalidArgumentError",
    "InvalidCheckpointError",
    "LeaseLostError",
    "LeaseNotFoundError",
    "LeasesActiveError",
    "LoadedWeights",
    "ModelExistsError",
    "ModelFailedError",
    "ModelLoadingError",
    "ModelNotFoundError",
    "Node",
    "NotSameHostError",
    "PermissionDeniedError",
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

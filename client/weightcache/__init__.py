"""weightcache: get a checkpoint's weights from the local weight-cache daemon, or from disk.

>>> import weightcache
>>> with weightcache.load("/models/llama") as weights:   # doctest: +SKIP
...     weights.source, weights.fallback_reason
"""

from weightcache._checkpoint import (
    Checkpoint,
    ShardInfo,
    TensorInfo,
    hub_snapshot,
    open_checkpoint,
)
from weightcache._errors import (
    DaemonUnavailableError,
    DrainingError,
    FingerprintMismatchError,
    HandleError,
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

__all__ = [
    "ENTRY_POINT_GROUP",
    "EXIT_LEASE_LOST",
    "PROTOCOL_VERSION",
    "Checkpoint",
    "DaemonUnavailableError",
    "DrainingError",
    "FallbackReason",
    "Fingerprint",
    "FingerprintMismatchError",
    "HandleError",
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

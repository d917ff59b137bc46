"""weightcache: get a checkpoint's weights from the local weight-cache daemon, or from disk.

>>> import weightcache
>>> with weightcache.load("/models/llama") as weights:   # doctest: +SKIP
...     weights.source, weights.fallback_reason
"""

from weightcache._checkpoint import Checkpoint, ShardInfo, TensorInfo, open_checkpoint
from weightcache._errors import (
    DaemonUnavailableError,
    DrainingError,
    FingerprintMismatchError,
    InvalidArgumentError,
    InvalidCheckpointError,
    LeaseLostError,
    LeaseNotFoundError,
    LeasesActiveError,
    ModelExistsError,
    ModelFailedError,
    ModelLoadingError,
    ModelNotFoundError,
    PermissionDeniedError,
    RecipeError,
    RemoteError,
    ResourceExhaustedError,
    WeightCacheError,
)
from weightcache._fingerprint import Fingerprint, compute_fingerprint
from weightcache._lease import EXIT_LEASE_LOST
from weightcache._loader import FallbackReason, LoadedWeights, load, load_from_disk
from weightcache._module import load_into
from weightcache._recipe import Placement, Recipe
from weightcache._rpc import default_socket
from weightcache._version import PROTOCOL_VERSION, __version__

__all__ = [
    "EXIT_LEASE_LOST",
    "PROTOCOL_VERSION",
    "Checkpoint",
    "DaemonUnavailableError",
    "DrainingError",
    "FallbackReason",
    "Fingerprint",
    "FingerprintMismatchError",
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
    "PermissionDeniedError",
    "Placement",
    "Recipe",
    "RecipeError",
    "RemoteError",
    "ResourceExhaustedError",
    "ShardInfo",
    "TensorInfo",
    "WeightCacheError",
    "__version__",
    "compute_fingerprint",
    "default_socket",
    "load",
    "load_from_disk",
    "load_into",
    "open_checkpoint",
]

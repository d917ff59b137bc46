"""Exceptions raised by weightcache, and the reason codes they carry.

Every exception derives from :class:`WeightCacheError` and carries ``reason``: the
``google.rpc.ErrorInfo`` reason the daemon sent (AIP-193), or the client's own code for
failures that never reached a daemon. ``metadata`` holds the ErrorInfo metadata.

Hierarchy::

    WeightCacheError
    ├── DaemonUnavailableError      no daemon at the socket, or it stopped answering
    ├── InvalidCheckpointError      the checkpoint is malformed (both sides; never falls back)
    ├── RecipeError                 the recipe or placement cannot apply to this checkpoint
    ├── LeaseLostError              a lease ended while its tensors were in use
    ├── UntrustedSocketError        the socket or a segment is a symlink or not trusted
    ├── HandleError                 a storage handle cannot be opened or a view is bad
    ├── DeviceNotVisibleError       the daemon's GPU is not visible to this process
    ├── CudaError                   a CUDA/HIP runtime call failed
    ├── MissingTensorError          a module's tensor is neither in the checkpoint nor
    │                               computable by the module's own code (``names``)
    └── RemoteError                 the daemon refused a request
        ├── FingerprintMismatchError    a held model differs; ``components`` says where
        ├── ModelNotFoundError          no held model resembles the request
        ├── ModelLoadingError           the model is still loading (``progress``)
        ├── ModelFailedError            the model failed to load in the daemon
        ├── LeaseNotFoundError          the lease is unknown to this daemon instance
        ├── LeasesActiveError           Evict without force while leases are live
        ├── ResourceExhaustedError      the model does not fit the memory budget
        ├── PermissionDeniedError       remote Preload is off, the path is not allowed, or a
        │                               TCP client certificate is not in the allow-list
        ├── InvalidArgumentError        a request field is malformed (``field``)
        ├── ModelExistsError            Preload of a model already held
        ├── DrainingError               the daemon is shutting down
        ├── NotSameHostError            Acquire over TCP from another host
        ├── UnauthenticatedError        an RPC over TCP that needs a client certificate
        └── InternalError               the daemon failed unexpectedly (``exception``)
"""

from __future__ import annotations

from collections.abc import Mapping

ERROR_DOMAIN = "weightcache.v1"

#: Client-side reason: no daemon answered at the socket.
DAEMON_UNAVAILABLE = "DAEMON_UNAVAILABLE"


class WeightCacheError(Exception):
    """Base of every weightcache exception.

    Attributes:
        reason: upper-snake reason code, e.g. ``"FINGERPRINT_MISMATCH"``.
        detail: human-readable explanation (also ``str(exc)``).
        metadata: ErrorInfo metadata, string to string.
    """

    reason: str = "UNKNOWN"
    #: gRPC status code name the daemon sends this error with (``google.rpc.Code``);
    #: only the classes of :data:`DAEMON_ERRORS` reach the wire.
    status_code: str = "INTERNAL"

    def __init__(
        self, detail: str, *, reason: str | None = None, metadata: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(detail)
        self.detail = detail
        if reason is not None:
            self.reason = reason
        self.metadata: dict[str, str] = dict(metadata or {})


class DaemonUnavailableError(WeightCacheError):
    """No daemon answered at the socket, or the connection to it broke."""

    reason = DAEMON_UNAVAILABLE


class InvalidCheckpointError(WeightCacheError):
    """The checkpoint is malformed: the message names the file and what is wrong.

    Raised by the checkpoint reader on either side; the daemon sends it as
    ``INVALID_CHECKPOINT``. Loading from disk cannot fix it, so it is never a fallback.
    """

    reason = "INVALID_CHECKPOINT"
    status_code = "INVALID_ARGUMENT"


class RecipeError(WeightCacheError, ValueError):
    """The recipe or placement cannot be applied (unknown dtype, bad rank)."""

    reason = "INVALID_RECIPE"
    status_code = "INVALID_ARGUMENT"


class LeaseLostError(WeightCacheError):
    """A lease ended while its tensors were in use (daemon gone, expired, revoked)."""

    reason = "LEASE_LOST"


class UntrustedSocketError(WeightCacheError):
    """The socket, its folder or a segment is a symlink or belongs to an untrusted user."""

    reason = "UNTRUSTED_SOCKET"


class HandleError(WeightCacheError):
    """A storage handle cannot be opened, or a tensor view does not fit its arena."""

    reason = "INVALID_HANDLE"


class DeviceNotVisibleError(WeightCacheError):
    """The daemon's device is not visible to this process (``CUDA_VISIBLE_DEVICES``)."""

    reason = "DEVICE_NOT_VISIBLE"


class CudaError(WeightCacheError):
    """A CUDA (HIP) runtime call failed; the message names the call and the error."""

    reason = "CUDA_ERROR"


class MissingTensorError(WeightCacheError, ValueError):
    """A tensor of the module is on the ``meta`` device, the checkpoint does not hold it,
    and the module's own code does not compute it (``load_into``; the rule:
    ``weightcache._missing``, docs/protocol.md "Tensors the checkpoint lacks").

    Raised before the module is changed. A parameter the checkpoint lacks is always
    refused (a weight is never computed); a buffer when neither the nearest
    ``transformers.PreTrainedModel``'s ``_init_weights`` nor the owning module's
    ``reset_parameters()`` writes it. A ``ValueError`` too, as ``load_into``'s other
    mismatches between module and checkpoint.

    Attributes:
        names: each tensor's dotted name in the module (``metadata["names"]``,
            comma-separated); the message says why for each.
    """

    reason = "MISSING_TENSOR"

    @classmethod
    def of(cls, why: dict[str, str]) -> MissingTensorError:
        """The error naming each tensor of ``why`` (name to reason), sorted by name."""
        names = sorted(why)
        lines = "; ".join(f"{n}: {why[n]}" for n in names)
        return cls(
            f"{len(names)} tensor(s) of the module neither in the checkpoint nor computed "
            f"by the module's own code, left on the meta device: {lines}",
            metadata={"names": ",".join(names)},
        )

    @property
    def names(self) -> list[str]:
        raw = self.metadata.get("names", "")
        return [n for n in raw.split(",") if n]


class RemoteError(WeightCacheError):
    """The daemon refused a request with a ``google.rpc.Status``."""


class FingerprintMismatchError(RemoteError):
    """A held model resembles the request but its fingerprint differs.

    Attributes:
        components: names of the differing components, e.g.
            ``["checkpoint/model-00002-of-00002.safetensors"]``, ``["recipe"]``.
    """

    reason = "FINGERPRINT_MISMATCH"
    status_code = "NOT_FOUND"

    @property
    def components(self) -> list[str]:
        raw = self.metadata.get("components", "")
        return [c for c in raw.split(",") if c]


class ModelNotFoundError(RemoteError):
    """No held model has the fingerprint, and none resembles it."""

    reason = "MODEL_NOT_FOUND"
    status_code = "NOT_FOUND"


class ModelLoadingError(RemoteError):
    """The model is still loading; ``metadata`` has ``bytes_done`` and ``bytes_total``."""

    reason = "MODEL_LOADING"
    status_code = "UNAVAILABLE"


class ModelFailedError(RemoteError):
    """The model failed to load in the daemon."""

    reason = "MODEL_FAILED"
    status_code = "FAILED_PRECONDITION"


class LeaseNotFoundError(RemoteError):
    """The lease is unknown to this daemon instance."""

    reason = "LEASE_NOT_FOUND"
    status_code = "NOT_FOUND"


class LeasesActiveError(RemoteError):
    """Evict without force while leases are live; ``metadata["leases"]`` counts them."""

    reason = "LEASES_ACTIVE"
    status_code = "FAILED_PRECONDITION"


class ResourceExhaustedError(RemoteError):
    """The model does not fit in the daemon's memory budget."""

    reason = "RESOURCE_EXHAUSTED"
    status_code = "RESOURCE_EXHAUSTED"


class PermissionDeniedError(RemoteError):
    """Remote Preload is off, or the path lies outside every allowed model root; or a TCP
    peer's client certificate names no subject in the daemon's ``--tls-client-subject``
    list (``metadata["method"]`` names the RPC refused)."""

    reason = "PERMISSION_DENIED"
    status_code = "PERMISSION_DENIED"


class InvalidArgumentError(RemoteError):
    """A request field is malformed; ``metadata["field"]`` names it."""

    reason = "INVALID_ARGUMENT"
    status_code = "INVALID_ARGUMENT"


class ModelExistsError(RemoteError):
    """Preload of a model the daemon already holds."""

    reason = "MODEL_EXISTS"
    status_code = "ALREADY_EXISTS"


class DrainingError(RemoteError):
    """The daemon is draining and grants no new leases."""

    reason = "DRAINING"
    status_code = "UNAVAILABLE"


class NotSameHostError(RemoteError):
    """Acquire from another host: shared-memory and CUDA IPC handles open only locally."""

    reason = "NOT_SAME_HOST"
    status_code = "FAILED_PRECONDITION"


class UnauthenticatedError(RemoteError):
    """A TCP peer without a verified client certificate called an RPC that needs one
    (anything but health, and the read-only RPCs the operator may open);
    ``metadata["method"]`` names the RPC. Use the Unix socket, or mutual TLS."""

    reason = "UNAUTHENTICATED"
    status_code = "UNAUTHENTICATED"


class InternalError(RemoteError):
    """The daemon failed in a way it does not describe; ``metadata["exception"]`` names
    the exception type and the daemon's log has the traceback."""

    reason = "INTERNAL"
    status_code = "INTERNAL"


#: Every reason a daemon sends, with the one exception class that carries it. The proto's
#: ``ErrorReason`` enum names the same reasons (``ERROR_REASON_<reason>``), and each class's
#: ``status_code`` is the gRPC code that enum's comment documents (tests/test_errors.py).
DAEMON_ERRORS: dict[str, type[WeightCacheError]] = {
    cls.reason: cls
    for cls in (
        FingerprintMismatchError,
        ModelNotFoundError,
        ModelLoadingError,
        ModelFailedError,
        LeaseNotFoundError,
        LeasesActiveError,
        ResourceExhaustedError,
        PermissionDeniedError,
        InvalidArgumentError,
        ModelExistsError,
        DrainingError,
        NotSameHostError,
        UnauthenticatedError,
        InvalidCheckpointError,
        RecipeError,
        InternalError,
    )
}


def error_for_reason(
    reason: str, detail: str, metadata: Mapping[str, str] | None = None
) -> WeightCacheError:
    """Build the exception class that matches a daemon's ErrorInfo reason.

    An unknown reason yields a plain :class:`RemoteError` carrying it.
    """
    cls = DAEMON_ERRORS.get(reason, RemoteError)
    return cls(detail, reason=reason, metadata=metadata)

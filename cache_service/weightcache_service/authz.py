"""Which peer may call which RPC: the daemon's authorization model (SECURITY.md).

- A Unix-socket peer is authenticated by the filesystem (the socket folder's and the
  socket's modes, ``--group``): it may call every RPC.
- A TCP peer that presented a client certificate verified against ``--tls-client-ca``
  (mutual TLS) is authenticated; with ``--tls-client-subject`` given, it may call every
  RPC only if its certificate names one of those subjects.
- Every other TCP peer (plaintext ``--insecure``, TLS without ``--tls-client-ca``, or a
  certificate subject outside the allow-list) may call the health service, and the
  read-only RPCs (GetServerInfo, ListModels, GetModel, reflection) only with
  ``--allow-unauthenticated-info``. Anything else ends with UNAUTHENTICATED (reason
  ``UNAUTHENTICATED``: no credentials), or PERMISSION_DENIED (reason ``PERMISSION_DENIED``:
  a certificate the allow-list does not name), following the gRPC status code
  definitions (grpc/doc/statuscodes.md) and AIP-193.

One :class:`AuthorizationInterceptor` applies :data:`RULES` to every RPC before its
handler runs; a method missing from the table needs an authenticated peer.
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeAlias

import grpc

from weightcache.core.errors import PermissionDeniedError, UnauthenticatedError, WeightCacheError
from weightcache_service.access import peer_is_unix
from weightcache_service.interceptors import Behaviour, Handler, MethodWrapper, abort, rewrap

Check: TypeAlias = Callable[[Any], Awaitable[None]]


class Need(enum.Enum):
    """What a peer needs to call an RPC."""

    ANYONE = "anyone"  #: health: load balancers and kubelet probes have no credentials
    INFO = "info"  #: read-only; unauthenticated TCP only with --allow-unauthenticated-info
    AUTHENTICATED = "authenticated"  #: leases, loading and eviction
    #: seeding a peer: --allow-seeding, then an authenticated peer (docs/seeding.md)
    SEED = "seed"


_SERVICE = "/weightcache.v1.WeightCacheService/"
#: Full method name -> what it needs. Methods not listed need an authenticated peer.
RULES: dict[str, Need] = {
    "/grpc.health.v1.Health/Check": Need.ANYONE,
    "/grpc.health.v1.Health/Watch": Need.ANYONE,
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo": Need.INFO,
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo": Need.INFO,
    _SERVICE + "GetServerInfo": Need.INFO,
    _SERVICE + "ListModels": Need.INFO,
    _SERVICE + "GetModel": Need.INFO,
    _SERVICE + "Acquire": Need.AUTHENTICATED,
    _SERVICE + "KeepAlive": Need.AUTHENTICATED,
    _SERVICE + "Release": Need.AUTHENTICATED,
    _SERVICE + "Evict": Need.AUTHENTICATED,
    _SERVICE + "Preload": Need.AUTHENTICATED,
    _SERVICE + "ListLeases": Need.AUTHENTICATED,
    _SERVICE + "BeginSeed": Need.SEED,
    _SERVICE + "ReadSeedData": Need.SEED,
    _SERVICE + "EndSeed": Need.SEED,
}

#: auth_context() keys of a verified client certificate's names (grpc/grpc_security_constants.h).
_NAME_KEYS = ("x509_common_name", "x509_subject_alternative_name", "x509_subject")


@dataclass(frozen=True)
class Policy:
    """The operator's TCP settings that authorization depends on.

    Attributes:
        mutual_tls: the TCP listener verifies client certificates (``--tls-client-ca``).
        subjects: certificate names allowed (``--tls-client-subject``); empty: any
            certificate the CA signed.
        unauthenticated_info: unauthenticated TCP peers may call the read-only RPCs.
        allow_seeding: ``--allow-seeding``: authenticated peers may seed from this daemon
            (BeginSeed, ReadSeedData, EndSeed); off, everyone is refused them.
    """

    mutual_tls: bool = False
    subjects: frozenset[str] = frozenset()
    unauthenticated_info: bool = False
    allow_seeding: bool = False


def certificate_names(context: grpc.aio.ServicerContext[Any, Any]) -> set[str]:
    """The names a TCP peer's verified client certificate carries: common name, subject
    alternative names and the subject's distinguished name (``CN=...``), as gRPC reports
    them in ``auth_context()``; empty without a certificate."""
    auth = context.auth_context()
    if auth.get("transport_security_type") != [b"ssl"]:
        return set()
    return {value.decode(errors="replace") for key in _NAME_KEYS for value in auth.get(key, [])}


def refusal(method: str, policy: Policy, peer: str, names: set[str]) -> WeightCacheError | None:
    """Why ``peer`` may not call ``method``, or None when it may.

    Args:
        method: full method name, ``/package.Service/Method``.
        policy: the operator's settings.
        peer: ``context.peer()`` (``unix:...`` for the Unix socket).
        names: the peer's verified certificate names (:func:`certificate_names`).

    Returns:
        None, an :class:`UnauthenticatedError` (no credentials) or a
        :class:`PermissionDeniedError` (a certificate the allow-list does not name);
        ``metadata["method"]`` names the method.
    """
    need = RULES.get(method, Need.AUTHENTICATED)
    name = method.rpartition("/")[2]
    if need is Need.SEED and not policy.allow_seeding:
        return PermissionDeniedError(
            f"{name} refused: seeding is off on this daemon (started without --allow-seeding)",
            metadata={"method": name},
        )
    if need is Need.ANYONE or peer_is_unix(peer):
        return None
    certified = policy.mutual_tls and bool(names)
    if certified and (not policy.subjects or names & policy.subjects):
        return None
    if need is Need.INFO and policy.unauthenticated_info:
        return None
    if certified:
        return PermissionDeniedError(
            f"{name} refused: the client certificate ({', '.join(sorted(names))}) names no "
            "subject in the daemon's --tls-client-subject list",
            metadata={"method": name},
        )
    return UnauthenticatedError(
        f"{name} needs an authenticated peer: the Unix socket, or TCP with a client "
        "certificate that the daemon's --tls-client-ca signed",
        metadata={"method": name},
    )


class AuthorizationInterceptor(MethodWrapper):
    """Refuses each RPC that :func:`refusal` refuses, before its handler runs."""

    def __init__(self, policy: Policy) -> None:
        super().__init__()
        self.policy = policy

    def applies(self, method: str) -> bool:
        """Every method but the health checks, which anyone may call."""
        return RULES.get(method) is not Need.ANYONE

    def wrap(self, handler: Handler, method: str) -> Handler:
        """``handler`` with the peer checked before its behaviour runs."""

        async def check(context: grpc.aio.ServicerContext[Any, Any]) -> None:
            error = refusal(method, self.policy, context.peer(), certificate_names(context))
            if error is not None:
                await abort(context, error)

        return rewrap(handler, lambda _kind, behaviour: _checked(behaviour, check))


def _checked(behaviour: Behaviour, check: Check) -> Behaviour:
    # Streaming handlers are async generators (ours, reflection) or coroutines that write
    # through the context; the wrapper must be of the same kind for grpc.aio to drive it.
    if inspect.isasyncgenfunction(behaviour):

        async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
            await check(context)
            async for reply in behaviour(request, context):
                yield reply

        return stream

    async def call(request: Any, context: Any) -> Any:
        await check(context)
        return await behaviour(request, context)

    return call

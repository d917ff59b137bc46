"""What the daemon's server interceptors share: ending an RPC with a rich status, and
replacing a method handler's behaviour whatever its kind (unary or streaming).

:class:`MethodWrapper` is the base of :class:`~weightcache_service.authz.AuthorizationInterceptor`
and :class:`~weightcache_service.guard.StatusGuard`: it wraps each method's handler once
(Acquire and KeepAlive pass through on every call) and hands the wrapped one out after.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeAlias

import grpc

from weightcache.core.errors import WeightCacheError
from weightcache.core.status import to_grpc_status

Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"
Behaviour: TypeAlias = Callable[[Any, Any], Any]

# grpc's classes are generic only in grpc-stubs, not at run time.
if TYPE_CHECKING:
    _Interceptor = grpc.aio.ServerInterceptor[Any, Any]
else:
    _Interceptor = grpc.aio.ServerInterceptor


async def abort(context: grpc.aio.ServicerContext[Any, Any], error: WeightCacheError) -> None:
    """End the RPC with ``error`` as a rich status (always raises ``AbortError``)."""
    status = to_grpc_status(error)
    await context.abort(status.code, status.details, status.trailing_metadata)


class Kind(enum.Enum):
    """A method's shape: whether requests, replies or both are streams."""

    UNARY_UNARY = "unary_unary"
    UNARY_STREAM = "unary_stream"
    STREAM_UNARY = "stream_unary"
    STREAM_STREAM = "stream_stream"

    @property
    def streams_requests(self) -> bool:
        """The handler is given an async iterator of requests."""
        return self in (Kind.STREAM_UNARY, Kind.STREAM_STREAM)

    @property
    def streams_replies(self) -> bool:
        """The handler is an async generator of replies (or writes through the context)."""
        return self in (Kind.UNARY_STREAM, Kind.STREAM_STREAM)


_MAKERS = {
    Kind.UNARY_UNARY: grpc.unary_unary_rpc_method_handler,
    Kind.UNARY_STREAM: grpc.unary_stream_rpc_method_handler,
    Kind.STREAM_UNARY: grpc.stream_unary_rpc_method_handler,
    Kind.STREAM_STREAM: grpc.stream_stream_rpc_method_handler,
}


def rewrap(
    handler: Any,
    wrap: Callable[[Kind, Behaviour], Behaviour],
    deserializer: Callable[[bytes], Any] | None = None,
) -> Handler:
    """A handler of the same kind whose behaviour is ``wrap(kind, behaviour)``, with the
    same serializers (or ``deserializer`` in place of the request deserializer)."""
    kind = next(k for k in Kind if getattr(handler, k.value) is not None)
    return _MAKERS[kind](
        wrap(kind, getattr(handler, kind.value)),
        request_deserializer=deserializer or handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


class MethodWrapper(_Interceptor):
    """An interceptor that replaces the handler of each method it :meth:`applies` to by
    :meth:`wrap` of it, built once per method."""

    def __init__(self) -> None:
        self._wrapped: dict[str, Handler] = {}

    def applies(self, method: str) -> bool:
        """Whether ``method`` (``/package.Service/Method``) is wrapped."""
        raise NotImplementedError

    def wrap(self, handler: Handler, method: str) -> Handler:
        """The handler to serve ``method`` with instead of ``handler``."""
        raise NotImplementedError

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler:
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method
        if handler is None or not self.applies(method):
            return handler
        wrapped = self._wrapped.get(method)
        if wrapped is None:
            wrapped = self._wrapped[method] = self.wrap(handler, method)
        return wrapped

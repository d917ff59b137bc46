"""A server interceptor that gives every failure of the service a rich status.

Without it, grpc.aio answers a request whose bytes do not parse, or a handler that raises
something unexpected, with a bare ``UNKNOWN`` and no ``google.rpc.ErrorInfo``. With it:

- undecodable request bytes: ``INVALID_ARGUMENT``, reason ``INVALID_ARGUMENT``,
  ``metadata["field"] = "request"`` (the deserializer returns a marker instead of raising,
  and the handler refuses the marker);
- any other exception escaping a handler: ``INTERNAL``, reason ``INTERNAL``,
  ``metadata["exception"]`` the exception's type name (the message says no more, so that
  nothing internal leaks).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
import structlog
from google.protobuf.message import DecodeError

from weightcache.core.errors import InternalError, InvalidArgumentError, WeightCacheError
from weightcache_service.status import to_grpc_status

log = structlog.get_logger("weightcache.daemon")

Handler = Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Any]


@dataclass(frozen=True)
class Undecodable:
    """What the wrapped deserializer returns for bytes that do not parse."""

    method: str
    error: str

    def refusal(self) -> InvalidArgumentError:
        return InvalidArgumentError(
            f"the request to {self.method} does not decode: {self.error}",
            metadata={"field": "request"},
        )


async def _abort(context: grpc.aio.ServicerContext[Any, Any], error: WeightCacheError) -> None:
    status = to_grpc_status(error)
    await context.abort(status.code, status.details, status.trailing_metadata)


def _internal(method: str, exc: Exception) -> InternalError:
    log.error("handler failed", method=method, exc_info=exc)
    return InternalError(
        f"internal error in {method}; the daemon's log has the details",
        metadata={"exception": type(exc).__name__},
    )


if TYPE_CHECKING:
    _Interceptor = grpc.aio.ServerInterceptor[Any, Any]
else:  # the stubs are generic, the runtime class is not
    _Interceptor = grpc.aio.ServerInterceptor


class StatusGuard(_Interceptor):
    """Wraps the handlers of the methods under ``prefix`` (e.g. ``/weightcache.v1.X/``).

    Args:
        prefix: method path prefix of the service to guard.
    """

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        # Wrapped once per method, not per call: Acquire and KeepAlive pass through here.
        self._wrapped: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method
        if handler is None or not method.startswith(self._prefix):
            return handler
        wrapped = self._wrapped.get(method)
        if wrapped is None:
            wrapped = self._wrapped[method] = _guarded(handler, method)
        return wrapped


def _guarded(handler: Any, method: str) -> grpc.RpcMethodHandler[Any, Any]:
    parse = handler.request_deserializer

    def deserialize(raw: bytes) -> Any:
        try:
            return parse(raw)
        except DecodeError as exc:
            return Undecodable(method, str(exc))

    serialize = handler.response_serializer
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(
            _unary(handler.unary_unary, method), deserialize, serialize
        )
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(
            _unary_stream(handler.unary_stream, method), deserialize, serialize
        )
    if handler.stream_stream is not None:
        return grpc.stream_stream_rpc_method_handler(
            _stream_stream(handler.stream_stream, method), deserialize, serialize
        )
    return grpc.stream_unary_rpc_method_handler(
        _stream_unary(handler.stream_unary, method), deserialize, serialize
    )


def _unary(inner: Handler, method: str) -> Handler:
    async def behaviour(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        if isinstance(request, Undecodable):
            await _abort(context, request.refusal())
        try:
            return await inner(request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _abort(context, _internal(method, exc))

    return behaviour


def _unary_stream(inner: Handler, method: str) -> Handler:
    async def behaviour(
        request: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        if isinstance(request, Undecodable):
            await _abort(context, request.refusal())
        try:
            async for response in inner(request, context):
                yield response
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _abort(context, _internal(method, exc))

    return behaviour


class _Requests:
    """A request stream that ends at the first undecodable message and keeps it."""

    def __init__(self, requests: AsyncIterator[Any]) -> None:
        self._requests = requests
        self.bad: Undecodable | None = None

    async def __aiter__(self) -> AsyncIterator[Any]:
        async for request in self._requests:
            if isinstance(request, Undecodable):
                self.bad = request
                return
            yield request


def _stream_stream(inner: Handler, method: str) -> Handler:
    async def behaviour(
        requests: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        checked = _Requests(requests)
        try:
            async for response in inner(checked.__aiter__(), context):
                yield response
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _abort(context, _internal(method, exc))
        if checked.bad is not None:
            await _abort(context, checked.bad.refusal())

    return behaviour


def _stream_unary(inner: Handler, method: str) -> Handler:
    async def behaviour(
        requests: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]
    ) -> Any:
        checked = _Requests(requests)
        try:
            response = await inner(checked.__aiter__(), context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _abort(context, _internal(method, exc))
        if checked.bad is not None:
            await _abort(context, checked.bad.refusal())
        return response

    return behaviour

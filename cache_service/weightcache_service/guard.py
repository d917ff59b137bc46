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

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import structlog
from google.protobuf.message import DecodeError

from weightcache.core.errors import InternalError, InvalidArgumentError
from weightcache_service.interceptors import Behaviour, Handler, Kind, MethodWrapper, abort, rewrap

log = structlog.get_logger("weightcache.daemon")


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


def _internal(method: str, exc: Exception) -> InternalError:
    log.error("handler failed", method=method, exc_info=exc)
    return InternalError(
        f"internal error in {method}; the daemon's log has the details",
        metadata={"exception": type(exc).__name__},
    )


class StatusGuard(MethodWrapper):
    """Wraps the handlers of the methods under ``prefix`` (e.g. ``/weightcache.v1.X/``).

    Args:
        prefix: method path prefix of the service to guard.
    """

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self._prefix = prefix

    def applies(self, method: str) -> bool:
        """The methods of the guarded service."""
        return method.startswith(self._prefix)

    def wrap(self, handler: Handler, method: str) -> Handler:
        """``handler`` with undecodable requests refused and unexpected exceptions turned
        into INTERNAL."""
        parse = handler.request_deserializer
        if parse is None:  # generated service handlers always parse their requests
            return handler

        def deserialize(raw: bytes) -> Any:
            try:
                return parse(raw)
            except DecodeError as exc:
                return Undecodable(method, str(exc))

        return rewrap(handler, lambda kind, inner: _WRAPPERS[kind](inner, method), deserialize)


def _unary(inner: Behaviour, method: str) -> Behaviour:
    async def behaviour(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        if isinstance(request, Undecodable):
            await abort(context, request.refusal())
        try:
            return await inner(request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await abort(context, _internal(method, exc))

    return behaviour


def _unary_stream(inner: Behaviour, method: str) -> Behaviour:
    async def behaviour(
        request: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        if isinstance(request, Undecodable):
            await abort(context, request.refusal())
        try:
            async for response in inner(request, context):
                yield response
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await abort(context, _internal(method, exc))

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


def _stream_stream(inner: Behaviour, method: str) -> Behaviour:
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
            await abort(context, _internal(method, exc))
        if checked.bad is not None:
            await abort(context, checked.bad.refusal())

    return behaviour


def _stream_unary(inner: Behaviour, method: str) -> Behaviour:
    async def behaviour(
        requests: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]
    ) -> Any:
        checked = _Requests(requests)
        try:
            response = await inner(checked.__aiter__(), context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await abort(context, _internal(method, exc))
        if checked.bad is not None:
            await abort(context, checked.bad.refusal())
        return response

    return behaviour


_WRAPPERS: dict[Kind, Callable[[Behaviour, str], Behaviour]] = {
    Kind.UNARY_UNARY: _unary,
    Kind.UNARY_STREAM: _unary_stream,
    Kind.STREAM_UNARY: _stream_unary,
    Kind.STREAM_STREAM: _stream_stream,
}

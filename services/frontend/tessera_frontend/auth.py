"""API keys on the frontend's public ports (`--api-key` / TESSERA_API_KEY, one key or several
separated by commas; empty: no authentication, as vLLM's --api-key).

HTTP: every path but /health needs `Authorization: Bearer <key>`; otherwise 401 with
OpenAI's error body (code "invalid_api_key") and `WWW-Authenticate: Bearer`, answered
before the body is read. gRPC: every method but grpc.health.v1's needs `authorization:
Bearer <key>` metadata; otherwise UNAUTHENTICATED. Keys are compared in constant time.
"""
from __future__ import annotations

import hmac
import json
from typing import Iterable

import grpc

from tessera_frontend.openai_protocol import ApiError

HTTP_EXEMPT_PATHS = frozenset({"/health"})
GRPC_EXEMPT_PREFIX = "/grpc.health.v1.Health/"
MISSING = "an API key is required: send it as 'Authorization: Bearer <key>'"
WRONG = "the API key is not valid"


def parse_api_keys(value: str | None) -> list[str]:
    """`--api-key`'s value: comma-separated keys, blanks dropped."""
    return [k.strip() for k in (value or "").split(",") if k.strip()]


class ApiKeys:
    """The accepted keys; `check` says what is wrong with an Authorization value, or None."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._keys = [k.encode() for k in keys]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def check(self, authorization: str | bytes | None) -> str | None:
        if not self._keys:
            return None
        if isinstance(authorization, bytes):
            authorization = authorization.decode("latin-1")
        scheme, _, token = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return MISSING
        given = token.strip().encode()
        # every key compared (no early exit): the time taken says nothing about which matched
        matched = False
        for key in self._keys:
            matched |= hmac.compare_digest(given, key)
        return None if matched else WRONG


class ApiKeyMiddleware:
    """ASGI middleware: 401 for an HTTP request without a valid key (see the module doc)."""

    def __init__(self, app, keys: ApiKeys) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") in HTTP_EXEMPT_PATHS:
            return await self.app(scope, receive, send)
        problem = self.keys.check(dict(scope.get("headers") or []).get(b"authorization"))
        if problem is None:
            return await self.app(scope, receive, send)
        body = json.dumps(ApiError(401, problem, code="invalid_api_key", type="invalid_request_error").body()).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """gRPC server interceptor: UNAUTHENTICATED for a call without a valid key (health exempt)."""

    def __init__(self, keys: ApiKeys) -> None:
        self.keys = keys

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(GRPC_EXEMPT_PREFIX):
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        problem = self.keys.check(metadata.get("authorization"))
        if problem is None:
            return handler
        return _refusing(handler, problem)


def _refusing(handler: grpc.RpcMethodHandler, problem: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that ends the call with UNAUTHENTICATED."""
    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, problem)

    async def streaming(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, problem)
        yield  # (never reached: makes this an async generator, as a streaming handler must be)

    make = {(False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler}[(handler.request_streaming, handler.response_streaming)]
    return make(streaming if handler.response_streaming else unary,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)

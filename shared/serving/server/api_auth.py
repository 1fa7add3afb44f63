"""The optional bearer token on the public Generate API (router, colocated pod; gRPC and HTTP): where the
token comes from, the check of an authorization value, and the server interceptor that answers a call
without it UNAUTHENTICATED. Health and reflection stay open (probes and tools carry no token)."""
from __future__ import annotations

import hmac
import logging
from dataclasses import dataclass, field
from typing import Mapping

import grpc

from shared.serving.server.secret_file import read_secret_file
from shared.serving.server.settings import setting

logger = logging.getLogger(__name__)

# Read when no token file is given.
TOKEN_ENV_VAR = "PDSERVE_API_TOKEN"
PUBLIC_METHOD_PREFIX = "/pdserve.v1.GenerateService/"


@dataclass(frozen=True)
class ApiAuthConfig:
    """Where the public API's bearer token comes from; without one the API is open."""

    api_token_file: str = field(default="", metadata=setting(
        f"file holding the bearer token Generate callers must send (metadata 'authorization: Bearer TOKEN'); "
        f"default: the {TOKEN_ENV_VAR} environment variable, and no token required when neither is set"
    ))

    def load(self, env: Mapping[str, str]) -> str | None:
        if self.api_token_file:
            return read_secret_file(self.api_token_file, "--api-token-file")
        if TOKEN_ENV_VAR not in env:
            return None
        token = env[TOKEN_ENV_VAR].strip()
        if not token:
            # Set but blank is a mistake (an empty Secret, say), not a wish to leave the API open.
            raise ValueError(f"{TOKEN_ENV_VAR} is set but blank: give it a token, or unset it to leave the "
                             "public API open")
        return token


def log_token_requirement(token: str | None) -> None:
    """The start-up line saying whether the public API needs a token (never the token itself)."""
    if token is None:
        logger.info("the public API (Generate, HTTP /v1) is open: no bearer token required")
    else:
        logger.info("the public API (Generate, HTTP /v1) requires a bearer token")


def bearer_matches(given: bytes, token: str) -> bool:
    """Whether an authorization value is 'Bearer <token>': the scheme in any case (RFC 7235), the token
    compared in constant time (no timing hints at how much of a guess was right)."""
    scheme, _, credentials = given.strip().partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(credentials.strip(), token.encode())


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata a client sends with token (none without one)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Answers a public-API call UNAUTHENTICATED unless it carries 'authorization: Bearer <token>'."""

    def __init__(self, token: str):
        self._token = token

    def _is_authorized(self, metadata) -> bool:
        given = next((value for key, value in metadata or () if key == "authorization"), "")
        given = given.encode() if isinstance(given, str) else given
        return bearer_matches(given, self._token)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(PUBLIC_METHOD_PREFIX):
            return handler
        if self._is_authorized(handler_call_details.invocation_metadata):
            return handler
        logger.warning("refused %s: missing or wrong bearer token", method)
        return _refusing_handler(handler, method)


def _refusing_handler(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    async def refuse(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{method} needs 'authorization: Bearer <token>'")

    async def refuse_stream(request_or_iterator, context):
        await refuse(request_or_iterator, context)
        yield  # never reached: makes this an async generator, as a streaming handler is

    serializers = dict(
        request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
    )
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(refuse, **serializers)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, **serializers)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(refuse, **serializers)
    return grpc.stream_stream_rpc_method_handler(refuse_stream, **serializers)

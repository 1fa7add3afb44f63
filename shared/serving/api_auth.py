"""The optional bearer token on the public Generate API (router, colocated pod): where the token comes
from, and the server interceptor that answers a call without it UNAUTHENTICATED. Health and reflection
stay open (probes and tools carry no token)."""
from __future__ import annotations

import hmac
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import grpc

from shared.serving.settings import setting

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
            try:
                token = Path(self.api_token_file).read_text().strip()
            except OSError as exc:
                raise ValueError(f"cannot read --api-token-file {self.api_token_file}: {exc}") from None
            if not token:
                raise ValueError(f"--api-token-file {self.api_token_file} is empty")
            return token
        return env.get(TOKEN_ENV_VAR, "").strip() or None


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata a client sends with token (none without one)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Answers a public-API call UNAUTHENTICATED unless it carries 'authorization: Bearer <token>'."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    def _is_authorized(self, metadata) -> bool:
        given = next((value for key, value in metadata or () if key == "authorization"), "")
        given = given.encode() if isinstance(given, str) else given
        return hmac.compare_digest(given, self._expected)

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

"""What every endpoint of the OpenAI front shares: the generate call, the model's names and codec, the
settings, and the checks a request passes before its endpoint reads it (key, readiness, body, model)."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from opentelemetry import trace
from prometheus_client import CollectorRegistry
from starlette.requests import Request
from starlette.responses import Response

from shared.serving.server.api_auth import bearer_matches
from shared.serving.generation import Generate
from shared.serving.openai.config import HttpConfig
from shared.serving.openai.errors import error, invalid
from shared.serving.pod.outcomes import InvalidRequest
from shared.serving.text import TextCodec

logger = logging.getLogger(__name__)
NO_TRACER = trace.NoOpTracer()


@dataclass
class FrontState:
    """The server an endpoint answers for. codec: the text codec (chat templates, logprobs' token texts)
    once known; api_key: the bearer token clients must send (None: open); model_aliases: other names
    requests may give the model by (the path it was loaded from, as vLLM names it)."""

    generate: Generate
    model_name: str
    codec: Callable[[], TextCodec | None]
    registry: CollectorRegistry
    is_ready: Callable[[], bool]
    max_model_len: Callable[[], int | None] = lambda: None
    api_key: str | None = None
    config: HttpConfig = HttpConfig()
    model_aliases: tuple[str, ...] = ()
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def model_names(self) -> set[str]:
        return {self.model_name, *self.model_aliases}

    def token_texts(self, token_ids: list[int]) -> list[str]:
        codec = self.codec()
        if codec is None:  # vLLM's way of naming tokens without a tokenizer
            return [f"token_id:{token_id}" for token_id in token_ids]
        return codec.token_texts(token_ids)

    # ---- checks -------------------------------------------------------------------------------
    def check_key(self, request: Request) -> Response | None:
        if self.api_key is None:
            return None
        # Starlette decodes header values as latin-1: encoding them back gives the bytes that were sent.
        given = request.headers.get("authorization", "").encode("latin-1")
        if not bearer_matches(given, self.api_key):
            logger.warning("refused %s %s: missing or wrong bearer token", request.method, request.url.path)
            return error(401, "authentication_error", "missing or wrong API key (Authorization: Bearer ...)")
        return None

    def check_ready(self) -> Response | None:
        if self.is_ready():
            return None
        return error(503, "server_error", "the model is not ready yet (loading, or no healthy worker)",
                     headers={"Retry-After": "1"})

    async def request_body(self, request: Request) -> dict[str, Any] | Response:
        """The request's JSON body, or the answer that ends it first: 401 without the key, 413 past the size
        limit, 400 when it is not a JSON object, 404 for another model. Parsed off the event loop (a large
        body takes long)."""
        if (denied := self.check_key(request)) is not None:
            return denied
        try:
            body = await asyncio.to_thread(_parse_body, await self._raw_body(request))
        except BodyTooLarge as exc:
            return error(413, "invalid_request_error", str(exc))
        except InvalidRequest as exc:
            return invalid(exc)
        return self.unknown_model(body) or body

    async def _raw_body(self, request: Request) -> bytes:
        """The body's bytes; BodyTooLarge as soon as it is known to pass the limit (nothing more is read)."""
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise BodyTooLarge(limit)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge(limit)
            chunks.append(chunk)
        return b"".join(chunks)

    def unknown_model(self, body: dict[str, Any]) -> Response | None:
        """400 for a model named by something other than a string, 404 (OpenAI's model_not_found) for a
        model this server does not serve."""
        model = body.get("model")
        if model is None:
            return None
        if not isinstance(model, str):
            return invalid(InvalidRequest(f"model must be a string, got {type(model).__name__}", "model"))
        if model in self.model_names:
            return None
        return error(404, "invalid_request_error", f"The model `{model}` does not exist (this server serves "
                     f"`{self.model_name}`).", param="model", code="model_not_found")


class BodyTooLarge(Exception):
    def __init__(self, limit: int):
        super().__init__(f"the request body is larger than {limit // 2**20} MiB (the server's --http-max-body-mib)")


def _parse_body(raw: bytes) -> dict[str, Any]:
    """The JSON object of a request body, or InvalidRequest saying why not."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"the body is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidRequest("the body's JSON nests too deeply") from None
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object")
    if b"\\ud" in raw.lower():  # JSON may escape a lone UTF-16 surrogate, which no UTF-8 text can carry
        try:
            json.dumps(body, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise InvalidRequest("the body has a string with an unpaired UTF-16 surrogate (\\ud800-\\udfff)") from None
    return body

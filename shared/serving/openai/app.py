"""The OpenAI-compatible HTTP front as an ASGI app (Starlette, served by uvicorn in the gRPC server's process
and event loop): each path to its endpoint, CORS, and one HTTP server span per generation request. The
endpoints call the router's or the colocated pod's generate() directly."""
from __future__ import annotations

import functools
from typing import Callable

from opentelemetry import trace
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.routing import Route

from shared.serving.generation import Generate
from shared.serving.openai import chat, completions, models, responses
from shared.serving.openai.config import CHAT_COMPLETIONS_PATH, COMPLETIONS_PATH, RESPONSES_PATH, HttpConfig
from shared.serving.openai.errors import http_exception, internal_error
from shared.serving.openai.state import NO_TRACER, FrontState
from shared.serving.server.http_tracing import HttpTracingMiddleware
from shared.serving.text import TextCodec

# path -> (endpoint, method); each endpoint takes the FrontState and the request.
_ROUTES = (
    (COMPLETIONS_PATH, completions.completions, "POST"),
    (CHAT_COMPLETIONS_PATH, chat.chat_completions, "POST"),
    (RESPONSES_PATH, responses.responses, "POST"),
    ("/v1/models", models.models, "GET"),
    ("/v1/models/{model:path}", models.model, "GET"),
    ("/tokenize", models.tokenize, "POST"),
    ("/detokenize", models.detokenize, "POST"),
    ("/health", models.health, "GET"),
    ("/metrics", models.metrics, "GET"),
)


class HttpFront:
    """The ASGI app (`.app`) over one domain generate()."""

    def __init__(
        self,
        generate: Generate,
        *,
        model_name: str,
        codec: Callable[[], TextCodec | None],
        registry: CollectorRegistry,
        is_ready: Callable[[], bool],
        max_model_len: Callable[[], int | None] = lambda: None,
        api_key: str | None = None,
        tracer: Callable[[], trace.Tracer] = lambda: NO_TRACER,
        config: HttpConfig = HttpConfig(),
        model_aliases: tuple[str, ...] = (),
    ):
        """tracer: the service's tracer (its tracing may be set up after this front), for one server span
        per generation request; config: the front's flags (body limit, tool-call and reasoning parsers; its
        port and model name are the caller's); the rest as FrontState's."""
        self.state = FrontState(generate, model_name, codec, registry, is_ready, max_model_len, api_key, config,
                                model_aliases)
        self.model_name = model_name
        routes = [Route(path, functools.partial(endpoint, self.state), methods=[method])
                  for path, endpoint, method in _ROUTES]
        app = Starlette(routes=routes, exception_handlers={HTTPException: http_exception, Exception: internal_error})
        if config.allowed_origins:
            app = CORSMiddleware(app, allow_origins=config.allowed_origins, allow_methods=["*"],
                                 allow_headers=["*"])
        # Probes and scrapes are not traced: their spans would bury the requests'.
        self.app = HttpTracingMiddleware(app, tracer,
                                         traced_paths=(COMPLETIONS_PATH, CHAT_COMPLETIONS_PATH, RESPONSES_PATH))

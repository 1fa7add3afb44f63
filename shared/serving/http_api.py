"""The OpenAI-compatible HTTP front (Starlette on uvicorn, in the gRPC server's process and event loop):
/v1/completions, /v1/chat/completions (SSE streaming or not; n choices, logprobs), /v1/models, /health and
/metrics. Requests go through the same in-process Generate path as gRPC calls, each in one trace under an
HTTP server span; a client that hangs up cancels its request."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import socket
import ssl
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

import grpc
import uvicorn
from opentelemetry import trace
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from proto.pdserve.v1 import generate_pb2
from shared.engine.request import FinishReason, TokenLogprobs
from shared.serving import convert, fan_out, openai_protocol as oai, responses_api
from shared.serving.api_auth import bearer_matches
from shared.serving.chat_template import ChatTemplateError
from shared.serving.outcomes import RETRY_AFTER_KEY, InvalidRequest, invalid_on_value_error
from shared.serving.reasoning import ReasoningParser, ReasoningStream, prompt_opens_thinking, split_reasoning
from shared.serving.settings import setting
from shared.serving.telemetry import HttpTracingMiddleware
from shared.serving.text import TextCodec, encode_text
from shared.serving.tls import TlsConfig
from shared.serving.tool_calls import ToolCallParser, ToolCallStream, ToolRequest, tool_call_objects, tool_request, \
    template_messages

logger = logging.getLogger(__name__)

# How an ended call's gRPC status shows over HTTP: (HTTP status, OpenAI error type).
_HTTP_OF_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (503, "server_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error"),
}
_SERVER_ERROR = (500, "server_error")
COMPLETIONS_PATH = "/v1/completions"
CHAT_COMPLETIONS_PATH = "/v1/chat/completions"
RESPONSES_PATH = "/v1/responses"
_NO_TRACER = trace.NoOpTracer()
# Enough of a chat prompt's end to see whether its template opened the model's thinking.
_PROMPT_TAIL_TOKENS = 16


def _none_if_empty(value: str | None) -> str | None:
    return value or None


@dataclass(frozen=True)
class HttpConfig:
    """The HTTP front's settings (flags of the router and the colocated server)."""

    http_port: int | None = field(default=None, metadata=setting(
        "OpenAI-compatible HTTP port (0 picks one; off when unset)"
    ))
    served_model_name: str | None = field(default=None, metadata=setting(
        "the model name the HTTP API answers to (default: the model or tokenizer name)", parse=_none_if_empty
    ))
    http_max_body_mib: int = field(default=16, metadata=setting(
        "largest request body the HTTP API reads, in MiB (a larger one gets 413 before it is parsed)"
    ))
    tool_call_parser: ToolCallParser | None = field(default=None, metadata=setting(
        'the format the model writes tool calls in, which chat\'s tool_choice "auto" reads them by (off when '
        'unset: "auto" is refused; named and "required" choices work without it)'
    ))
    reasoning_parser: ReasoningParser | None = field(default=None, metadata=setting(
        "read a reasoning model's <think>...</think> apart from its answer, as chat's reasoning (off when unset)"
    ))
    # Browsers may call the API from pages of these origins (CORS). The API's credential is a bearer token,
    # never a cookie, so "*" (vLLM's default) lets no page act with a user's ambient credentials.
    http_allowed_origins: str = field(default="*", metadata=setting(
        "comma-separated origins whose web pages may call the HTTP API (CORS; empty: none)"
    ))

    def __post_init__(self) -> None:
        if self.http_port is not None and not 0 <= self.http_port <= 65535:
            raise ValueError(f"http_port must be in [0, 65535], got {self.http_port}")
        if self.http_max_body_mib < 1:
            raise ValueError(f"http_max_body_mib must be at least 1, got {self.http_max_body_mib}")

    @property
    def max_body_bytes(self) -> int:
        return self.http_max_body_mib * 2**20

    @property
    def allowed_origins(self) -> list[str]:
        return [origin.strip() for origin in self.http_allowed_origins.split(",") if origin.strip()]


class CallEnded(grpc.aio.AbortError):
    """The in-process Generate call ended with a status (what context.abort sends over gRPC)."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing_metadata=()):
        super().__init__(details)
        self.code = code
        self.details = details
        self.trailing_metadata = tuple(trailing_metadata or ())

    @property
    def retry_after_header(self) -> dict[str, str]:
        """HTTP's Retry-After (whole seconds, at least 1) from the servicer's retry hint, if it gave one."""
        for key, value in self.trailing_metadata:
            if key == RETRY_AFTER_KEY and value.isdigit():
                # Retry-After takes whole seconds; the openai client reads retry-after-ms first.
                return {"Retry-After": str(max(1, math.ceil(int(value) / 1000))), "retry-after-ms": value}
        return {}


class InProcessContext:
    """The part of grpc.aio.ServicerContext the Generate servicers use, for calls made in process."""

    def __init__(self, timeout_s: float | None = None):
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._deadline = None if timeout_s is None else loop.time() + timeout_s

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - self._loop.time())

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata=()) -> None:
        raise CallEnded(code, details, trailing_metadata)

    def add_done_callback(self, callback) -> None:
        """Not needed in process: a call here ends when its generator is closed, and the servicers'
        own cleanup runs then (the callbacks cover a transport ending a call the generator missed)."""

    def invocation_metadata(self) -> tuple:
        return ()

    def peer(self) -> str:
        return "http"


Generate = Callable[[generate_pb2.GenerateRequest, InProcessContext], AsyncIterator[generate_pb2.GenerateResponse]]


def _error(status: int, error_type: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(oai.error_object(message, error_type, status), status_code=status, headers=headers)


def _ended_error(ended: CallEnded) -> JSONResponse:
    status, error_type = _HTTP_OF_CODE.get(ended.code, _SERVER_ERROR)
    return _error(status, error_type, ended.details, ended.retry_after_header)


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


def _named_sse(event: dict[str, Any]) -> str:
    """A Responses stream event: the SSE event name is its type."""
    return f"event: {event['type']}\n{_sse(event)}"


@dataclass
class _Choice:
    """One of the request's n completions, as its chunks arrive."""

    index: int
    text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish: FinishReason | None = None
    num_output_tokens: int = 0
    text_offset: int = 0  # completions' logprobs: where the next token starts in this choice's text
    has_started: bool = False
    tool_calls: ToolCallStream | None = None  # chat with tools: its text read for tool calls as it streams
    reasoning: ReasoningStream | None = None  # chat with a reasoning parser: its thinking read apart


@dataclass(frozen=True)
class _Echo:
    """A completion's echoed prompt: its text, its first token (which has no logprob) and whether the
    completion itself is left out (max_tokens 0)."""

    text: str
    first_token_id: int
    without_output: bool


@dataclass(frozen=True)
class _Request:
    """What the front needs of one parsed OpenAI request besides the Generate message."""

    options: oai.StreamOptions
    wants_logprobs: bool
    n: int = 1  # completions per prompt
    tools: ToolRequest | None = None  # chat only
    echoes: tuple[_Echo, ...] = ()  # completions with echo: one per prompt
    opens_thinking: bool | None = None  # chat with a reasoning parser: whether the prompt ends inside <think>


class _Response:
    """How one endpoint dresses Generate chunks (completions: text; chat: message or delta) for the n
    choices of one request: one OpenAI choice per completion index, usage over all of them."""

    def __init__(self, is_chat: bool, model: str, parsed: _Request, token_texts: oai.TokenTexts,
                 token_bytes: oai.TokenBytes | None = None):
        self.is_chat = is_chat
        self.ids = oai.ResponseIds.new("chatcmpl" if is_chat else "cmpl", model)
        self._wants_logprobs = parsed.wants_logprobs
        self._tools = parsed.tools if parsed.tools is not None and parsed.tools.reads_calls else None
        self._n = parsed.n
        self._echoes = parsed.echoes
        self._opens_thinking = parsed.opens_thinking
        self._token_texts = token_texts
        self._token_bytes = token_bytes
        self._choices: dict[int, _Choice] = {}
        self._num_prompt_tokens: dict[int, int] = {}  # by prompt (a batch of completions has several)

    def _choice_of(self, chunk: generate_pb2.GenerateResponse) -> _Choice:
        """The chunk's choice, its token count brought up to date."""
        choice = self._choices.get(chunk.index)
        if choice is None:
            choice = self._choices[chunk.index] = _Choice(chunk.index)
            choice.tool_calls = self._tools.stream() if self._tools is not None else None
            if self._opens_thinking is not None:
                choice.reasoning = ReasoningStream(self._opens_thinking)
        echo = self._echo_of(choice)
        without_output = echo is not None and echo.without_output  # its one sampled token is not returned
        choice.num_output_tokens = 0 if without_output else chunk.num_output_tokens
        self._num_prompt_tokens[chunk.index // self._n] = chunk.num_prompt_tokens  # the same for its n choices
        return choice

    def _logprobs(self, choice: _Choice, entries: list[TokenLogprobs | int]) -> dict[str, Any] | None:
        if not self._wants_logprobs:
            return None
        if self.is_chat:
            return oai.chat_logprobs(entries, self._token_texts, self._token_bytes)
        logprobs, choice.text_offset = oai.completion_logprobs(entries, self._token_texts, choice.text_offset)
        return logprobs

    def streamed(self, chunk: generate_pb2.GenerateResponse) -> dict[str, Any] | None:
        """The stream event of one chunk: its choice, by index (chat: the role with the choice's first);
        None when it has nothing to say (its text waits to be read for tool calls)."""
        choice = self._choice_of(chunk)
        finish = convert.finish_reason_from_proto(chunk.finish_reason)
        if self.is_chat:
            logprobs = self._logprobs(choice, _token_logprobs(chunk))
            delta, finish_reason = self._chat_delta(choice, chunk.text, finish)
            if not delta and finish_reason is None and logprobs is None:
                return None
            dressed = oai.chat_delta(choice.index, delta, finish_reason, logprobs)
        else:
            text, entries = self._completion_piece(choice, chunk)
            dressed = oai.completion_choice(choice.index, text, finish, self._logprobs(choice, entries))
        choice.has_started = True
        return {**self.ids.envelope(self._object(chunk=True)), "choices": [dressed]}

    def _completion_piece(self, choice: _Choice, chunk: generate_pb2.GenerateResponse) -> tuple[str, list]:
        """A completion chunk's text and logprob entries, after the echoed prompt on the choice's first."""
        text, entries = chunk.text, _token_logprobs(chunk)
        echo = self._echo_of(choice)
        if echo is None:
            return text, entries
        if echo.without_output:
            text, entries = "", []
        if not choice.has_started:
            prompt_entries = [convert.token_logprobs_from_proto(entry) for entry in chunk.prompt_logprobs]
            text = echo.text + text
            entries = [echo.first_token_id, *prompt_entries, *entries]
        return text, entries

    def _echo_of(self, choice: _Choice) -> _Echo | None:
        return self._echoes[choice.index // self._n] if self._echoes else None

    def _chat_delta(self, choice: _Choice, text: str,
                    finish: FinishReason | None) -> tuple[dict[str, Any], str | None]:
        """A chat chunk's delta (reasoning, content, or tool calls read from the text) and its finish reason."""
        finish_reason = oai.finish_reason_to_openai(finish)
        reasoning = ""
        if choice.reasoning is not None:
            split = choice.reasoning.push(text)
            if finish is not None:
                rest = choice.reasoning.finish()
                split.reasoning += rest.reasoning
                split.content += rest.content
            reasoning, text = split.reasoning, split.content
        if choice.tool_calls is None:
            delta: dict[str, Any] = {"content": text} if text or not (choice.has_started or reasoning) else {}
        else:
            read = choice.tool_calls.push(text)
            if finish is not None:
                rest = choice.tool_calls.finish()
                read.content += rest.content
                read.tool_calls += rest.tool_calls
                finish_reason = self._tools.finish_reason(finish_reason, choice.tool_calls.found_calls)
            delta = {"content": read.content} if read.content else {}
            if read.tool_calls:
                delta["tool_calls"] = read.tool_calls
        if reasoning:
            delta = {**oai.reasoning_fields(reasoning), **delta}
        if not choice.has_started:
            delta = {"role": "assistant", **delta}
        return delta, finish_reason

    def collect(self, chunk: generate_pb2.GenerateResponse) -> None:
        choice = self._choice_of(chunk)
        text, entries = (chunk.text, _token_logprobs(chunk)) if self.is_chat else self._completion_piece(choice, chunk)
        choice.has_started = True
        choice.text += text
        choice.logprobs.extend(entries)
        choice.finish = convert.finish_reason_from_proto(chunk.finish_reason) or choice.finish

    def whole(self) -> dict[str, Any]:
        """The response of everything collected: every choice in index order, and the usage."""
        dress = self._chat_choice if self.is_chat else self._completion_choice
        choices = [dress(choice) for choice in sorted(self._choices.values(), key=lambda c: c.index)]
        return {**self.ids.envelope(self._object(chunk=False)), "choices": choices, "usage": self.usage()}

    def _completion_choice(self, choice: _Choice) -> dict[str, Any]:
        return oai.completion_choice(choice.index, choice.text, choice.finish, self._logprobs(choice, choice.logprobs))

    def _chat_choice(self, choice: _Choice) -> dict[str, Any]:
        logprobs = self._logprobs(choice, choice.logprobs)
        finish_reason = oai.finish_reason_to_openai(choice.finish)
        reasoning, text = None, choice.text
        if self._opens_thinking is not None:
            reasoning, text = split_reasoning(text, self._opens_thinking)
            text = text if reasoning is None or text else None  # all thinking: no content, as vLLM
        if self._tools is None:
            return oai.chat_choice(choice.index, text, finish_reason, logprobs, reasoning=reasoning)
        content, calls = self._tools.calls_in(text) if text is not None else (None, [])
        finish_reason = self._tools.finish_reason(finish_reason, bool(calls))
        return oai.chat_choice(choice.index, content, finish_reason, logprobs, tool_call_objects(calls), reasoning)

    def usage_chunk(self) -> dict[str, Any]:
        return {**self.ids.envelope(self._object(chunk=True)), "choices": [], "usage": self.usage()}

    def usage(self) -> dict[str, int]:
        """Each prompt once, the output tokens of every choice."""
        num_output_tokens = sum(choice.num_output_tokens for choice in self._choices.values())
        return oai.usage(sum(self._num_prompt_tokens.values()), num_output_tokens)

    def _object(self, chunk: bool) -> str:
        if self.is_chat:
            return "chat.completion.chunk" if chunk else "chat.completion"
        return "text_completion"


def _token_logprobs(chunk: generate_pb2.GenerateResponse) -> list[TokenLogprobs]:
    return [convert.token_logprobs_from_proto(entry) for entry in chunk.logprobs]


class HttpFront:
    """The ASGI app over one Generate servicer."""

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
        tracer: Callable[[], trace.Tracer] = lambda: _NO_TRACER,
        config: HttpConfig = HttpConfig(),
        model_aliases: tuple[str, ...] = (),
    ):
        """codec: the text codec (for chat templates and logprobs' token texts) once known; api_key: the
        bearer token clients must send (None: open); tracer: the service's tracer (its tracing may be set
        up after this front), for one server span per generation request; config: the front's flags (body
        limit, tool-call and reasoning parsers; its port and model name are the caller's); model_aliases:
        other names requests may give the model by (the path it was loaded from, as vLLM names it)."""
        self._generate = generate
        self.model_name = model_name
        self._model_names = {model_name, *model_aliases}
        self._codec = codec
        self._registry = registry
        self._is_ready = is_ready
        self._max_model_len = max_model_len
        self._api_key = api_key
        self._max_body_bytes = config.max_body_bytes
        self._tool_call_parser = config.tool_call_parser
        self._reasoning_parser = config.reasoning_parser
        self._created = int(time.time())
        app = Starlette(routes=[
            Route(COMPLETIONS_PATH, self._completions, methods=["POST"]),
            Route(CHAT_COMPLETIONS_PATH, self._chat_completions, methods=["POST"]),
            Route(RESPONSES_PATH, self._responses, methods=["POST"]),
            Route("/v1/models", self._models, methods=["GET"]),
            Route("/v1/models/{model:path}", self._model, methods=["GET"]),
            Route("/tokenize", self._tokenize, methods=["POST"]),
            Route("/detokenize", self._detokenize, methods=["POST"]),
            Route("/health", self._health, methods=["GET"]),
            Route("/metrics", self._metrics, methods=["GET"]),
        ], exception_handlers={HTTPException: _http_exception, Exception: _internal_error})
        if config.allowed_origins:
            app = CORSMiddleware(app, allow_origins=config.allowed_origins, allow_methods=["*"],
                                 allow_headers=["*"])
        # Probes and scrapes are not traced: their spans would bury the requests'.
        self.app = HttpTracingMiddleware(app, tracer,
                                         traced_paths=(COMPLETIONS_PATH, CHAT_COMPLETIONS_PATH, RESPONSES_PATH))

    # ---- plain endpoints ----------------------------------------------------------------------
    async def _models(self, request: Request) -> Response:
        """The model list, once the model can serve: clients take a listed model as ready (vLLM's server
        answers nothing before it is)."""
        if (denied := self._check_key(request) or self._check_ready()) is not None:
            return denied
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def _model(self, request: Request) -> Response:
        """OpenAI's retrieve: the card of the model this server serves, else 404."""
        if (denied := self._check_key(request) or self._check_ready()) is not None:
            return denied
        if (unknown := self._unknown_model({"model": request.path_params["model"]})) is not None:
            return unknown
        return JSONResponse(self._model_card())

    def _model_card(self) -> dict[str, Any]:
        card = {"id": self.model_name, "object": "model", "created": self._created, "owned_by": "pdserve"}
        if (max_model_len := self._max_model_len()) is not None:
            card["max_model_len"] = max_model_len
        return card

    async def _tokenize(self, request: Request) -> Response:
        """vLLM's /tokenize: a prompt's token ids (a text, or chat messages rendered with the template)."""
        return await self._answer_tokenizer_call(request, self._tokenized)

    async def _detokenize(self, request: Request) -> Response:
        """vLLM's /detokenize: the text of token ids."""
        return await self._answer_tokenizer_call(request, self._detokenized)

    async def _answer_tokenizer_call(self, request: Request,
                                     answer: Callable[[dict[str, Any], TextCodec], dict]) -> Response:
        """A tokenizer endpoint's answer, computed off the event loop (400 when the input is wrong)."""
        body = await self._request_body(request)
        if isinstance(body, Response):
            return body
        try:
            codec = self._codec()
            if codec is None:
                raise InvalidRequest("this server has no tokenizer: start it with --tokenizer")
            return JSONResponse(await asyncio.to_thread(answer, body, codec))
        except InvalidRequest as exc:
            return _error(400, "invalid_request_error", str(exc))

    def _tokenized(self, body: dict[str, Any], codec: TextCodec) -> dict[str, Any]:
        if "messages" in body:
            oai.check_fields(body, ("messages", "chat_template_kwargs", "add_generation_prompt",
                                    "continue_final_message", "tools", "return_token_strs"))
            tools = tool_request({**body, "tool_choice": "none"}, None) if body.get("tools") is not None else None
            token_ids = self._chat_prompt(oai.chat_messages(body), oai.chat_template_options(body), tools)
        else:
            oai.check_fields(body, ("prompt", "add_special_tokens", "return_token_strs"))
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise InvalidRequest("'prompt' (a string) or 'messages' is required")
            add_special_tokens = body.get("add_special_tokens", True)
            token_ids = encode_text(codec.tokenizer, prompt,
                                    add_special_tokens=oai.boolean("add_special_tokens", add_special_tokens))
        answer = {"count": len(token_ids), "max_model_len": self._max_model_len(), "tokens": token_ids}
        if body.get("return_token_strs") is not None and oai.boolean("return_token_strs", body["return_token_strs"]):
            answer["token_strs"] = codec.token_texts(token_ids)
        return answer

    def _detokenized(self, body: dict[str, Any], codec: TextCodec) -> dict[str, Any]:
        oai.check_fields(body, ("tokens",))
        token_ids = list(oai.token_ids("tokens", body.get("tokens")))
        if (vocab_size := codec.vocab_size) and any(token >= vocab_size for token in token_ids):
            raise InvalidRequest(f"tokens must be ids below the vocabulary size {vocab_size}")
        return {"prompt": codec.decode(token_ids, skip_special_tokens=False)}  # as vLLM: special tokens kept

    async def _health(self, request: Request) -> Response:
        return Response(status_code=200 if self._is_ready() else 503)

    async def _metrics(self, request: Request) -> Response:
        return Response(generate_latest(self._registry), media_type=CONTENT_TYPE_LATEST)

    # ---- generation endpoints -----------------------------------------------------------------
    async def _completions(self, request: Request) -> Response:
        return await self._serve(request, is_chat=False)

    async def _chat_completions(self, request: Request) -> Response:
        return await self._serve(request, is_chat=True)

    async def _responses(self, request: Request) -> Response:
        return await self._serve(request, is_chat=True, as_responses=True)

    async def _serve(self, request: Request, *, is_chat: bool, as_responses: bool = False) -> Response:
        """One generation request: completions, chat, or the Responses API (a chat request underneath)."""
        body = await self._request_body(request)
        if isinstance(body, Response):
            return body
        try:
            chat = responses_api.chat_body(body) if as_responses else body
            # Chat rendering and tokenizing a large prompt take long: off the event loop.
            messages, parsed = await asyncio.to_thread(self._generate_requests, chat, is_chat)
        except InvalidRequest as exc:
            return _error(400, "invalid_request_error", str(exc))
        codec = self._codec()
        response = _Response(is_chat, self.model_name, parsed, self._token_texts,
                             codec.token_bytes if codec is not None else None)
        responses = self._generations(messages, parsed.n).__aiter__()
        try:
            # Bad input ends the call before its first chunk: answer it with a status, not a stream.
            first = await _unless_disconnected(request, anext(responses))
        except CallEnded as exc:
            return _ended_error(exc)
        except StopAsyncIteration:
            return _error(*_SERVER_ERROR, "the request ended without output")
        if first is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        if as_responses:
            return await self._as_response(request, responses_api.ResponseShell(body, self.model_name),
                                           parsed.options.is_streaming, response, first, responses)
        if parsed.options.is_streaming:
            return StreamingResponse(
                self._stream(response, parsed.options, first, responses), media_type="text/event-stream")
        return await self._whole(request, response, first, responses)

    def _generations(self, messages: list[generate_pb2.GenerateRequest], n: int) -> AsyncIterator:
        """The chunks of one Generate call per prompt, as they come; prompt i's completions are choices
        i*n .. i*n+n-1 (OpenAI's order for a batch of prompts)."""
        if len(messages) == 1:
            return self._generate(messages[0], InProcessContext())

        async def one(prompt_index: int) -> AsyncIterator:
            async for chunk in self._generate(messages[prompt_index], InProcessContext()):
                chunk.index += prompt_index * n
                yield chunk

        return fan_out.merge(one, len(messages))

    def _generate_requests(self, body: dict[str, Any],
                           is_chat: bool) -> tuple[list[generate_pb2.GenerateRequest], _Request]:
        with invalid_on_value_error():  # a value out of a proto field's range, for one
            return self._generate_requests_of(body, is_chat)

    def _generate_requests_of(self, body: dict[str, Any],
                              is_chat: bool) -> tuple[list[generate_pb2.GenerateRequest], _Request]:
        """One Generate message per prompt (chat has one; completions may send a batch) and what the
        response needs to know of the request."""
        default_max_tokens = oai.COMPLETIONS_DEFAULT_MAX_TOKENS
        tools = echo_options = opens_thinking = None
        echoes: tuple[_Echo, ...] = ()
        if is_chat:
            oai.check_fields(body, ("messages", "chat_template_kwargs", "add_generation_prompt",
                                    "continue_final_message", "logprobs", "top_logprobs", "tools", "tool_choice"))
            tools = tool_request(body, self._tool_call_parser)
            prompt = self._chat_prompt(oai.chat_messages(body), oai.chat_template_options(body), tools)
            prompts: list[str | list[int]] = [prompt]
            default_max_tokens = self._rest_of_context(len(prompt))
            if self._reasoning_parser is not None:
                opens_thinking = prompt_opens_thinking(self._codec().decode(prompt[-_PROMPT_TAIL_TOKENS:],
                                                                            skip_special_tokens=False))
        else:
            oai.check_fields(body, ("prompt", "logprobs", "echo"))
            prompts = oai.completion_prompts(body)
            echo_options = oai.completion_echo(body)
            if echo_options is not None:
                echoed = [self._echoed(prompt, echo_options) for prompt in prompts]
                prompts, echoes = [ids for ids, _ in echoed], tuple(echo for _, echo in echoed)
        options = oai.stream_options_from_openai(body)
        params = oai.sampling_params_from_openai(body, is_chat=is_chat, default_max_tokens=default_max_tokens,
                                                 tool_constraint=tools.constraint() if tools is not None else None,
                                                 echo=echo_options)
        sampling = convert.sampling_params_to_proto(params)
        request_id = body.get("request_id") or ""
        if not isinstance(request_id, str):
            raise InvalidRequest(f"request_id must be a string, got {request_id!r}")
        messages = []
        for index, prompt in enumerate(prompts):
            # A batch's prompts run as requests of their own, each with an id of its own.
            message_id = f"{request_id}-{index}" if request_id and len(prompts) > 1 else request_id
            message = generate_pb2.GenerateRequest(request_id=message_id, sampling=sampling)
            if isinstance(prompt, str):
                message.text = prompt
            else:
                message.token_ids.ids.extend(prompt)
            messages.append(message)
        return messages, _Request(options, wants_logprobs=params.logprobs is not None, n=params.n, tools=tools,
                                  echoes=echoes, opens_thinking=opens_thinking)

    def _echoed(self, prompt: str | list[int], options: oai.EchoOptions) -> tuple[list[int], _Echo]:
        """The prompt's token ids and its echo: the text as given (or as its token ids decode)."""
        codec = self._codec()
        if codec is None:
            raise InvalidRequest("echo needs a tokenizer: start the server with --tokenizer")
        token_ids = codec.encode(prompt) if isinstance(prompt, str) else prompt
        if not token_ids:
            raise InvalidRequest("prompt text encodes to no tokens")
        text = prompt if isinstance(prompt, str) else codec.decode(prompt)
        return token_ids, _Echo(text, token_ids[0], options.without_output)

    def _rest_of_context(self, num_prompt_tokens: int) -> int:
        """Chat's max_tokens when the request names none and the checkpoint's generation_config.json no
        max_new_tokens, as vLLM does: the rest of the model's length (at least 1, so a prompt that fills
        it is refused for its length). It travels as fallback_max_tokens; the pod fills the rest."""
        max_model_len = self._max_model_len()
        if max_model_len is None:  # no pod has reported yet: the request will not run anyway
            return oai.COMPLETIONS_DEFAULT_MAX_TOKENS
        return max(1, max_model_len - num_prompt_tokens)

    def _token_texts(self, token_ids: list[int]) -> list[str]:
        codec = self._codec()
        if codec is None:  # vLLM's way of naming tokens without a tokenizer
            return [f"token_id:{token_id}" for token_id in token_ids]
        return codec.token_texts(token_ids)

    def _chat_prompt(self, messages: list[dict], options: oai.ChatTemplateOptions,
                     tools: ToolRequest | None) -> list[int]:
        codec = self._codec()
        if codec is None:
            raise InvalidRequest("chat needs a tokenizer with a chat template: start the server with --tokenizer")
        try:
            return codec.encode_chat(template_messages(messages), **dataclasses.asdict(options),
                                     tools=list(tools.tools) if tools is not None else None)
        except ChatTemplateError as exc:  # no template, or the template refused the messages
            raise InvalidRequest(f"chat template: {exc}") from None

    async def _as_response(self, request: Request, shell: "responses_api.ResponseShell", is_streaming: bool,
                           response: _Response, first, responses) -> Response:
        """The chat answer as a Response object, or as Responses stream events."""
        if is_streaming:
            events = self._response_events(responses_api.ResponseEvents(shell), response, first, responses)
            return StreamingResponse(events, media_type="text/event-stream")
        if (failed := await self._collect(request, response, first, responses)) is not None:
            return failed
        whole = response.whole()
        [choice] = whole["choices"]
        return JSONResponse(shell.response("completed", responses_api.output_items(choice["message"]),
                                           whole["usage"], choice["finish_reason"]))

    async def _response_events(self, events: "responses_api.ResponseEvents", response: _Response, first,
                               responses) -> AsyncIterator[str]:
        """Responses stream events (SSE with their event names, as OpenAI sends them) of a chat stream."""
        chunk, finish_reason = first, None
        try:
            for event in events.started():
                yield _named_sse(event)
            while chunk is not None:
                payload = response.streamed(chunk)
                for choice in payload["choices"] if payload is not None else ():
                    finish_reason = choice.get("finish_reason") or finish_reason
                    for event in events.chunk(choice):
                        yield _named_sse(event)
                chunk = await anext(responses, None)
            for event in events.finished(finish_reason, response.usage()):
                yield _named_sse(event)
        except CallEnded as exc:
            for event in events.failed(exc.details, exc.code.name.lower()):
                yield _named_sse(event)
        finally:
            await responses.aclose()

    async def _whole(self, request: Request, response: _Response, first, responses) -> Response:
        failed = await self._collect(request, response, first, responses)
        return failed or JSONResponse(response.whole())

    async def _collect(self, request: Request, response: _Response, first, responses) -> Response | None:
        """Every chunk into response (None), or the answer to a call that ended otherwise."""
        async def collect():
            response.collect(first)
            async for chunk in responses:
                response.collect(chunk)
            return response

        try:
            collected = await _unless_disconnected(request, collect())
        except CallEnded as exc:
            return _ended_error(exc)
        finally:
            await responses.aclose()
        return Response(status_code=499) if collected is None else None

    async def _stream(self, response: _Response, options: oai.StreamOptions, first, responses) -> AsyncIterator[str]:
        """SSE events, one per chunk of any choice; a client that hangs up cancels this generator (and
        with it the request)."""
        chunk = first
        try:
            while chunk is not None:
                payload = response.streamed(chunk)
                if payload is not None:
                    if options.continuous_usage:
                        payload["usage"] = response.usage()
                    elif options.include_usage:
                        payload["usage"] = None
                    yield _sse(payload)
                chunk = await anext(responses, None)
            if options.include_usage:  # once every choice finished
                yield _sse(response.usage_chunk())
        except CallEnded as exc:
            status, error_type = _HTTP_OF_CODE.get(exc.code, _SERVER_ERROR)
            yield _sse(oai.error_object(exc.details, error_type, status))
        finally:
            await responses.aclose()
        yield "data: [DONE]\n\n"

    # ---- checks -------------------------------------------------------------------------------
    def _check_key(self, request: Request) -> Response | None:
        if self._api_key is None:
            return None
        # Starlette decodes header values as latin-1: encoding them back gives the bytes that were sent.
        given = request.headers.get("authorization", "").encode("latin-1")
        if not bearer_matches(given, self._api_key):
            logger.warning("refused %s %s: missing or wrong bearer token", request.method, request.url.path)
            return _error(401, "authentication_error", "missing or wrong API key (Authorization: Bearer ...)")
        return None

    async def _request_body(self, request: Request) -> dict[str, Any] | Response:
        """The request's JSON body, or the answer that ends it first: 401 without the key, 413 past the size
        limit, 400 when it is not a JSON object, 404 for another model. Parsed off the event loop (a large
        body takes long)."""
        if (denied := self._check_key(request)) is not None:
            return denied
        try:
            body = await asyncio.to_thread(_parse_body, await self._raw_body(request))
        except BodyTooLarge as exc:
            return _error(413, "invalid_request_error", str(exc))
        except InvalidRequest as exc:
            return _error(400, "invalid_request_error", str(exc))
        return self._unknown_model(body) or body

    def _check_ready(self) -> Response | None:
        if self._is_ready():
            return None
        return _error(503, "server_error", "the model is not ready yet (loading, or no healthy worker)",
                      headers={"Retry-After": "1"})

    async def _raw_body(self, request: Request) -> bytes:
        """The body's bytes; BodyTooLarge as soon as it is known to pass the limit (nothing more is read)."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self._max_body_bytes:
            raise BodyTooLarge(self._max_body_bytes)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self._max_body_bytes:
                raise BodyTooLarge(self._max_body_bytes)
            chunks.append(chunk)
        return b"".join(chunks)

    def _unknown_model(self, body: dict[str, Any]) -> Response | None:
        model = body.get("model")
        if model is None or model in self._model_names:
            return None
        return _error(404, "invalid_request_error", f"the model '{model}' does not exist (this server has "
                      f"'{self.model_name}')")


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


async def _http_exception(request: Request, exc: HTTPException) -> Response:
    """Unknown paths and methods answered as OpenAI error objects, like every other error."""
    return _error(exc.status_code, "invalid_request_error", f"{request.method} {request.url.path}: {exc.detail}")


async def _internal_error(request: Request, exc: Exception) -> Response:
    """A bug met by one request: an OpenAI error object, not a bare text page (the server logs the traceback)."""
    return _error(*_SERVER_ERROR, f"internal error: {type(exc).__name__}")


async def _unless_disconnected(request: Request, work: Awaitable):
    """work's result, or None when the client hangs up first (work is then cancelled)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return None
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _Uvicorn(uvicorn.Server):
    def capture_signals(self):
        # The gRPC server owns SIGTERM/SIGINT and stops this one with it.
        return contextlib.nullcontext()


def _uvicorn_tls(tls: TlsConfig) -> dict[str, Any]:
    """uvicorn's TLS settings for a service's TlsConfig, the same rule as its gRPC servers: HTTPS with its
    certificate when it has TLS on, and client certificates required and checked against --tls-ca when
    that is given (mTLS). Plain HTTP when TLS is off."""
    tls.require_server_certificate()
    if not tls.is_enabled:
        return {}
    options: dict[str, Any] = dict(ssl_certfile=tls.tls_cert, ssl_keyfile=tls.tls_key)
    if tls.tls_ca:
        options.update(ssl_ca_certs=tls.tls_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
    return options


class HttpServer:
    """uvicorn serving an app on the running event loop; HTTPS (and mTLS) when tls says so."""

    def __init__(self, app, host: str, port: int, tls: TlsConfig = TlsConfig()):
        self._app = app
        self.host = host
        self._tls_options = _uvicorn_tls(tls)  # checked before the port is bound
        self._socket = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._socket.bind((host, port))
        except OSError as exc:
            self._socket.close()
            raise OSError(f"cannot bind HTTP port {host}:{port}: {exc}") from None
        self.port = self._socket.getsockname()[1]
        self._server: _Uvicorn | None = None
        self._task: asyncio.Task | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        scheme = "https" if self._tls_options else "http"
        return f"{scheme}://{host}:{self.port}"

    async def start(self) -> None:
        config = uvicorn.Config(self._app, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=5, **self._tls_options)
        self._server = _Uvicorn(config)
        self._task = asyncio.ensure_future(self._server.serve(sockets=[self._socket]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise OSError(f"the HTTP server on {self.url} stopped while starting")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        await self._task
        self._server = None

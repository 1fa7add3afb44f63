"""The bench's OpenAI backend: the same workload through the HTTP API's streamed /v1/completions (token-id
prompts, SSE read with aiohttp, whose C parser keeps the client's own cost near the gRPC client's),
yielding chunks shaped like the gRPC client's so the figures compare."""
from __future__ import annotations

import json
import ssl
from dataclasses import dataclass
from typing import AsyncIterator, Sequence

import aiohttp

from shared.engine.request import FinishReason
from shared.serving.server.tls import TlsConfig

_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT,
           "error": FinishReason.ERROR}


class CallFailed(Exception):
    """The HTTP call ended with an error; the message says which."""


@dataclass(frozen=True)
class StreamedChunk:
    token_ids: list[int]  # placeholders: the count is what the bench measures
    finish_reason: FinishReason | None


class OpenAiBenchClient:
    """`async with OpenAiBenchClient("http://127.0.0.1:8000/v1") as client: client.generate(...)`."""

    def __init__(self, base_url: str, model: str | None = None, api_token: str | None = None,
                 tls: TlsConfig = TlsConfig()):
        """tls: the CA that verifies an https server (default: the system's) and a client certificate (mTLS)."""
        self._url = base_url.rstrip("/") + "/completions"
        self._model = model
        self._headers = {"Authorization": f"Bearer {api_token}"} if api_token else {}
        self._ssl = _ssl_context(tls)
        self._http: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> "OpenAiBenchClient":
        # One pooled connection per request in flight, like the gRPC channel's streams.
        connector = aiohttp.TCPConnector(limit=0, ssl=self._ssl if self._ssl is not None else True)
        self._http = aiohttp.ClientSession(connector=connector, headers=self._headers)
        return self

    async def __aexit__(self, *exc) -> None:
        await self._http.close()

    async def generate(self, prompt: Sequence[int], *, request_id: str, timeout: float | None, max_tokens: int,
                       ignore_eos: bool, temperature: float) -> AsyncIterator[StreamedChunk]:
        body = {
            "prompt": list(prompt), "max_tokens": max_tokens, "ignore_eos": ignore_eos, "temperature": temperature,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "request_id": request_id,
        }
        if self._model is not None:
            body["model"] = self._model
        num_tokens = 0
        try:
            async with self._http.post(self._url, json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as response:
                if response.status != 200:
                    text = await response.text(errors="replace")
                    raise CallFailed(f"HTTP {response.status}: {text[:300]}")
                async for raw in response.content:
                    line = raw.rstrip(b"\r\n")
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    event = json.loads(line[len(b"data: "):])
                    if "error" in event:
                        raise CallFailed(f"{event['error'].get('code')}: {event['error'].get('message')}")
                    if not event["choices"]:
                        continue  # the closing usage chunk
                    total = event["usage"]["completion_tokens"]
                    new, num_tokens = total - num_tokens, total
                    finish = event["choices"][0]["finish_reason"]
                    yield StreamedChunk([0] * new, _FINISH.get(finish) if finish else None)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise CallFailed(f"{type(exc).__name__}: {exc}") from None


def _ssl_context(tls: TlsConfig) -> ssl.SSLContext | None:
    """None: aiohttp's default verification (the system's CAs) for https."""
    if not tls.tls_ca and not tls.tls_cert:
        return None
    context = ssl.create_default_context(cafile=tls.tls_ca or None)
    if tls.tls_cert:
        context.load_cert_chain(tls.tls_cert, tls.tls_key)
    return context

"""A small Python client for the router's public Generate RPC (blocking and asyncio variants).

    with PdserveClient("127.0.0.1:50051") as client:
        for chunk in client.generate([1, 2, 3], max_tokens=8):
            print(chunk.token_ids, chunk.text)

Against a router with TLS and a bearer token:
`PdserveClient(address, tls=TlsConfig(tls_ca="ca.pem"), api_token="...")` (add tls_cert/tls_key for mTLS).
Sampling options are SamplingParams' fields (stop, presence_penalty, logprobs, n, seed, ...); a constraint
is one of json_schema (a dict or JSON text), json_object=True, regex or grammar.
"""
from __future__ import annotations

import json
from typing import AsyncIterator, Iterator, Sequence

import grpc

from proto.pdserve.v1 import generate_pb2, generate_pb2_grpc
from shared.serving.generation import GenerateChunk
from shared.serving.wire.generate import generate_chunk_from_proto
from shared.serving.wire.common import sampling_params_to_proto
from shared.serving.server.api_auth import bearer_metadata
from shared.serving.server.tls import TlsConfig
from shared.engine.request import MODEL_DEFAULT_FIELDS, SamplingParams, StructuredOutputSpec

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def _structured_output(sampling: dict) -> StructuredOutputSpec | None:
    """Pops the constraint kwargs (json_schema, json_object, regex, grammar) into one spec."""
    chosen = {name: sampling.pop(name) for name in ("json_schema", "json_object", "regex", "grammar") if name in sampling}
    if not chosen:
        return None
    if isinstance(chosen.get("json_schema"), dict):
        chosen["json_schema"] = json.dumps(chosen["json_schema"])
    return StructuredOutputSpec(**chosen)


def build_generate_request(
    prompt: str | Sequence[int], *, request_id: str | None = None, **sampling
) -> generate_pb2.GenerateRequest:
    """Validates the sampling kwargs (SamplingParams' fields) locally so mistakes fail before the call."""
    spec = _structured_output(sampling)
    if spec is not None:
        sampling["structured_output"] = spec
    # What the caller does not pass, the model's generation_config.json may give (else the server default).
    params = SamplingParams(**sampling, unset=MODEL_DEFAULT_FIELDS - sampling.keys())
    message = generate_pb2.GenerateRequest(
        request_id=request_id or "", sampling=sampling_params_to_proto(params)
    )
    if isinstance(prompt, str):
        message.text = prompt
    else:
        message.token_ids.ids.extend(int(t) for t in prompt)
    return message


def _auth_metadata(api_token: str | None) -> tuple[tuple[str, str], ...]:
    """The bearer token's metadata, the token stripped as the servers strip theirs: one read from a file
    ends in a newline, which gRPC metadata cannot carry."""
    return bearer_metadata(api_token.strip() if api_token else None)


def _channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


class PdserveClient:
    """Blocking client. generate() yields chunks; leaving the loop early cancels the call."""

    def __init__(self, address: str, *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 tls: TlsConfig = TlsConfig(), api_token: str | None = None):
        self.address = address
        self._channel = tls.channel(address, options=_channel_options(max_message_bytes))
        self._stub = generate_pb2_grpc.GenerateServiceStub(self._channel)
        self._metadata = _auth_metadata(api_token)

    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        request_id: str | None = None,
        timeout: float | None = None,
        **sampling,
    ) -> Iterator[GenerateChunk]:
        request = build_generate_request(prompt, request_id=request_id, **sampling)
        call = self._stub.Generate(request, timeout=timeout, metadata=self._metadata)
        try:
            for message in call:
                yield generate_chunk_from_proto(message)
        finally:
            call.cancel()  # no-op once the stream has ended

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "PdserveClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncPdserveClient:
    """asyncio client. `async for chunk in client.generate(...)`; leaving the loop early cancels the call."""

    def __init__(self, address: str, *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 tls: TlsConfig = TlsConfig(), api_token: str | None = None):
        self.address = address
        self._channel = tls.aio_channel(address, options=_channel_options(max_message_bytes))
        self._stub = generate_pb2_grpc.GenerateServiceStub(self._channel)
        self._metadata = _auth_metadata(api_token)

    async def generate(
        self,
        prompt: str | Sequence[int],
        *,
        request_id: str | None = None,
        timeout: float | None = None,
        **sampling,
    ) -> AsyncIterator[GenerateChunk]:
        request = build_generate_request(prompt, request_id=request_id, **sampling)
        call = self._stub.Generate(request, timeout=timeout, metadata=self._metadata)
        try:
            async for message in call:
                yield generate_chunk_from_proto(message)
        finally:
            call.cancel()

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncPdserveClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

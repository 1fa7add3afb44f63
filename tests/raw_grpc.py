"""Calling any gRPC method with raw request bytes (identity serializers), to send what no stub would."""
from __future__ import annotations

import grpc

# Field 1, length-delimited, claims 5 bytes but carries 2: no protobuf message parses from this.
GARBAGE = b"\x0a\x05ab"


async def call_with_raw_bytes(channel: grpc.aio.Channel, method: str, is_stream_response: bool,
                              is_stream_request: bool, data: bytes) -> grpc.aio.AioRpcError:
    """Send data as the request bytes, bypassing any serializer; the error the call ends with."""
    identity = dict(request_serializer=lambda raw: raw, response_deserializer=lambda raw: raw)
    try:
        if is_stream_request:
            call = channel.stream_stream(method, **identity)(iter([data]), timeout=10)
            async for _ in call:
                pass
        elif is_stream_response:
            async for _ in channel.unary_stream(method, **identity)(data, timeout=10):
                pass
        else:
            await channel.unary_unary(method, **identity)(data, timeout=10)
    except grpc.aio.AioRpcError as error:
        return error
    raise AssertionError(f"{method} accepted malformed bytes")

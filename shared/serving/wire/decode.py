"""The mapping of decode.proto: pull statistics and the Decode request and response."""
from __future__ import annotations

from proto.pdserve.v1 import decode_pb2
from shared.engine.kv_transfer.handle import KvPullOutcome, KvPullStats
from shared.engine.request import SamplingParams
from shared.serving.wire.payloads import DecodeChunk, DecodeInput
from shared.serving.wire.common import (
    UINT64_MAX, _check_uint, finish_reason_to_proto, finish_reason_from_proto, sampling_params_to_proto,
    sampling_params_from_proto, token_logprobs_to_proto, token_logprobs_from_proto, token_ids_from_proto,
    kv_handle_to_proto, kv_handle_from_proto, _request_id,
)


_OUTCOME_TO_PROTO = {
    KvPullOutcome.PULLED: decode_pb2.KV_PULL_OUTCOME_PULLED,
    KvPullOutcome.PREFIX_CACHE_HIT: decode_pb2.KV_PULL_OUTCOME_PREFIX_CACHE_HIT,
    KvPullOutcome.RECOMPUTED_LEASE_EXPIRED: decode_pb2.KV_PULL_OUTCOME_RECOMPUTED_LEASE_EXPIRED,
    KvPullOutcome.RECOMPUTED_ERROR: decode_pb2.KV_PULL_OUTCOME_RECOMPUTED_ERROR,
    KvPullOutcome.RECOMPUTED_LAYOUT_MISMATCH: decode_pb2.KV_PULL_OUTCOME_RECOMPUTED_LAYOUT_MISMATCH,
    KvPullOutcome.NO_HANDLE: decode_pb2.KV_PULL_OUTCOME_NO_HANDLE,
}
_OUTCOME_FROM_PROTO = {v: k for k, v in _OUTCOME_TO_PROTO.items()}


def kv_pull_stats_to_proto(stats: KvPullStats) -> decode_pb2.KvPullStats:
    if stats.outcome not in _OUTCOME_TO_PROTO:
        raise ValueError(f"not a KvPullOutcome: {stats.outcome!r}")
    if not stats.seconds >= 0.0:
        raise ValueError(f"kv pull seconds must be >= 0, got {stats.seconds}")
    return decode_pb2.KvPullStats(
        num_bytes=_check_uint("kv_pull.num_bytes", stats.num_bytes, UINT64_MAX),
        num_blocks=_check_uint("kv_pull.num_blocks", stats.num_blocks),
        num_cached_blocks=_check_uint("kv_pull.num_cached_blocks", stats.num_cached_blocks),
        seconds=stats.seconds,
        outcome=_OUTCOME_TO_PROTO[stats.outcome],
    )


def kv_pull_stats_from_proto(message: decode_pb2.KvPullStats) -> KvPullStats:
    if message.outcome not in _OUTCOME_FROM_PROTO:
        raise ValueError(f"unknown kv pull outcome enum value {message.outcome}")
    return KvPullStats(
        num_bytes=message.num_bytes,
        num_blocks=message.num_blocks,
        num_cached_blocks=message.num_cached_blocks,
        seconds=message.seconds,
        outcome=_OUTCOME_FROM_PROTO[message.outcome],
    )


def decode_request_to_proto(work: DecodeInput) -> decode_pb2.DecodeRequest:
    message = decode_pb2.DecodeRequest(
        request_id=_request_id(work.request_id),
        prompt_token_ids=[_check_uint("prompt_token_ids entry", t) for t in work.prompt_token_ids],
        generated_token_ids=[_check_uint("generated_token_ids entry", t) for t in work.generated_token_ids],
        sampling=sampling_params_to_proto(work.sampling),
    )
    if work.handle is not None:
        message.handle.CopyFrom(kv_handle_to_proto(work.handle))
    return message


def decode_request_from_proto(
    message: decode_pb2.DecodeRequest, *, vocab_size: int | None = None
) -> DecodeInput:
    prompt = token_ids_from_proto(message.prompt_token_ids, vocab_size=vocab_size)
    generated = token_ids_from_proto(
        message.generated_token_ids, name="generated_token_ids", vocab_size=vocab_size, allow_empty=True
    )
    sampling = sampling_params_from_proto(message.sampling if message.HasField("sampling") else None)
    handle = None
    if message.HasField("handle"):
        handle = kv_handle_from_proto(message.handle)
        if handle.num_tokens != len(prompt):
            raise ValueError(
                f"handle covers {handle.num_tokens} tokens but the prompt has {len(prompt)}"
            )
        if len(generated) != 1:
            raise ValueError(
                f"with a handle, generated_token_ids must hold exactly token 1, got {len(generated)} ids"
            )
    if sampling.prompt_logprobs is not None and (handle is not None or generated):
        raise ValueError("sampling: prompt_logprobs are computed with the prompt: ask for them only on a Decode "
                         "that computes it (no handle, no generated_token_ids)")
    if "max_tokens" not in sampling.unset:  # else the pod checks once it has filled max_tokens
        check_not_past_max_tokens(generated, sampling)
    return DecodeInput(
        request_id=_request_id(message.request_id),
        prompt_token_ids=prompt,
        generated_token_ids=generated,
        sampling=sampling,
        handle=handle,
    )


def check_not_past_max_tokens(generated: list[int], sampling: SamplingParams) -> None:
    """ValueError when more tokens were already generated than max_tokens allows. Exactly max_tokens is a
    complete request (a re-issue after a pod died right after the last token), answered as such."""
    if len(generated) > sampling.max_tokens:
        raise ValueError(
            f"{len(generated)} tokens already generated exceed max_tokens {sampling.max_tokens}"
        )


def decode_chunk_to_proto(chunk: DecodeChunk) -> decode_pb2.DecodeResponse:
    message = decode_pb2.DecodeResponse(
        token_ids=[_check_uint("token_ids entry", t) for t in chunk.token_ids],
        finish_reason=finish_reason_to_proto(chunk.finish_reason),
    )
    if chunk.kv_pull is not None:
        message.kv_pull.CopyFrom(kv_pull_stats_to_proto(chunk.kv_pull))
    message.logprobs.extend(token_logprobs_to_proto(entry) for entry in chunk.logprobs)
    message.prompt_logprobs.extend(token_logprobs_to_proto(entry) for entry in chunk.prompt_logprobs)
    return message


def decode_chunk_from_proto(message: decode_pb2.DecodeResponse) -> DecodeChunk:
    return DecodeChunk(
        token_ids=list(message.token_ids),
        finish_reason=finish_reason_from_proto(message.finish_reason),
        kv_pull=kv_pull_stats_from_proto(message.kv_pull) if message.HasField("kv_pull") else None,
        logprobs=[token_logprobs_from_proto(entry) for entry in message.logprobs],
        prompt_logprobs=[token_logprobs_from_proto(entry) for entry in message.prompt_logprobs],
    )

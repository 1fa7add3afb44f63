"""The mapping of prefill.proto: KV-source descriptions and the Prefill request and response."""
from __future__ import annotations

from proto.pdserve.v1 import prefill_pb2
from shared.engine.kv_transfer.handle import KvRegion, KvSource
from shared.engine.request import SamplingParams
from shared.serving.wire.payloads import PrefillInput, PrefillKvSource, PrefillResult
from shared.serving.wire.common import (
    UINT64_MAX, _check_uint, finish_reason_to_proto, finish_reason_from_proto, sampling_params_to_proto,
    sampling_params_from_proto, token_logprobs_to_proto, token_logprobs_from_proto, token_ids_from_proto,
    kv_layout_to_proto, kv_layout_from_proto, kv_handle_to_proto, kv_handle_from_proto, _request_id,
    _resolved,
)


_MEMORY_KIND_TO_PROTO = {"DRAM": prefill_pb2.MEMORY_KIND_DRAM, "VRAM": prefill_pb2.MEMORY_KIND_VRAM}
_MEMORY_KIND_FROM_PROTO = {v: k for k, v in _MEMORY_KIND_TO_PROTO.items()}


def kv_source_to_proto(described: PrefillKvSource) -> prefill_pb2.GetKvSourceResponse:
    source = described.source
    if source.mem_type not in _MEMORY_KIND_TO_PROTO:
        raise ValueError(f"mem_type must be one of {sorted(_MEMORY_KIND_TO_PROTO)}, got {source.mem_type!r}")
    return prefill_pb2.GetKvSourceResponse(
        engine_id=described.engine_id,
        agent_name=source.agent_name,
        agent_metadata=source.agent_metadata,
        layout=kv_layout_to_proto(described.layout),
        regions=[
            prefill_pb2.MemoryRegion(
                address=_check_uint("region.address", r.base_address, UINT64_MAX),
                length=_check_uint("region.length", r.num_bytes, UINT64_MAX),
                device_id=_check_uint("region.device_id", r.device_id),
            )
            for r in source.regions
        ],
        block_bytes=_check_uint("block_bytes", source.block_bytes, UINT64_MAX),
        num_blocks=_check_uint("num_blocks", source.num_blocks),
        memory_kind=_MEMORY_KIND_TO_PROTO[source.mem_type],
    )


def kv_source_from_proto(message: prefill_pb2.GetKvSourceResponse) -> PrefillKvSource:
    if not message.engine_id:
        raise ValueError("kv source engine_id is empty")
    if not message.agent_name:
        raise ValueError("kv source agent_name is empty")
    if message.memory_kind not in _MEMORY_KIND_FROM_PROTO:
        raise ValueError(f"kv source memory_kind {message.memory_kind} is not DRAM or VRAM")
    layout = kv_layout_from_proto(message.layout)
    if len(message.regions) != 2 * layout.num_layers:
        raise ValueError(
            f"kv source has {len(message.regions)} regions, expected 2 per layer ({2 * layout.num_layers})"
        )
    needed = message.block_bytes * message.num_blocks
    for index, region in enumerate(message.regions):
        if region.length < needed:
            raise ValueError(
                f"kv source region {index} is {region.length} bytes, smaller than "
                f"num_blocks * block_bytes = {needed}"
            )
    source = KvSource(
        agent_name=message.agent_name,
        agent_metadata=bytes(message.agent_metadata),
        mem_type=_MEMORY_KIND_FROM_PROTO[message.memory_kind],
        regions=tuple(KvRegion(r.address, r.length, r.device_id) for r in message.regions),
        block_bytes=message.block_bytes,
        num_blocks=message.num_blocks,
    )
    return PrefillKvSource(engine_id=message.engine_id, layout=layout, source=source)


def prefill_request_to_proto(
    request_id: str, prompt_token_ids: list[int], sampling: SamplingParams
) -> prefill_pb2.PrefillRequest:
    return prefill_pb2.PrefillRequest(
        request_id=_request_id(request_id),
        prompt_token_ids=[_check_uint("prompt_token_ids entry", t) for t in prompt_token_ids],
        sampling=sampling_params_to_proto(sampling),
    )


def prefill_request_from_proto(
    message: prefill_pb2.PrefillRequest, *, vocab_size: int | None = None
) -> PrefillInput:
    return PrefillInput(
        request_id=_request_id(message.request_id),
        prompt_token_ids=token_ids_from_proto(message.prompt_token_ids, vocab_size=vocab_size),
        sampling=sampling_params_from_proto(message.sampling if message.HasField("sampling") else None),
    )


def prefill_result_to_proto(result: PrefillResult) -> prefill_pb2.PrefillResponse:
    if (result.finish_reason is None) == (result.handle is None):
        raise ValueError("a prefill result carries exactly one of finish_reason and handle")
    message = prefill_pb2.PrefillResponse(
        first_token_id=_check_uint("first_token_id", result.first_token_id),
        finish_reason=finish_reason_to_proto(result.finish_reason),
        num_prompt_tokens=_check_uint("num_prompt_tokens", result.num_prompt_tokens),
    )
    if result.handle is not None:
        message.handle.CopyFrom(kv_handle_to_proto(result.handle))
    if result.first_token_logprobs is not None:
        message.first_token_logprobs.CopyFrom(token_logprobs_to_proto(result.first_token_logprobs))
    if result.resolved_sampling is not None:
        message.resolved_sampling.CopyFrom(sampling_params_to_proto(_resolved(result.resolved_sampling)))
    message.prompt_logprobs.extend(token_logprobs_to_proto(entry) for entry in result.prompt_logprobs)
    return message


def prefill_result_from_proto(message: prefill_pb2.PrefillResponse) -> PrefillResult:
    finish_reason = finish_reason_from_proto(message.finish_reason)
    has_handle = message.HasField("handle")
    if finish_reason is None and not has_handle:
        raise ValueError("prefill response has neither a finish_reason nor a KV handle")
    if finish_reason is not None and has_handle:
        raise ValueError("prefill response has both a finish_reason and a KV handle")
    return PrefillResult(
        first_token_id=message.first_token_id,
        num_prompt_tokens=message.num_prompt_tokens,
        finish_reason=finish_reason,
        handle=kv_handle_from_proto(message.handle) if has_handle else None,
        first_token_logprobs=(
            token_logprobs_from_proto(message.first_token_logprobs)
            if message.HasField("first_token_logprobs") else None
        ),
        resolved_sampling=(
            _resolved(sampling_params_from_proto(message.resolved_sampling))
            if message.HasField("resolved_sampling") else None
        ),
        prompt_logprobs=[token_logprobs_from_proto(entry) for entry in message.prompt_logprobs],
    )

"""The only proto <-> domain mapping: sampling params, finish reasons, KV handles and layouts, load,
KV-source descriptions, pull statistics and the prefill/decode request payloads.

Every `*_from_proto` validates and raises ValueError with a message that says what is wrong, so a
servicer can map it straight to INVALID_ARGUMENT.
"""
from __future__ import annotations

import math
from proto.pdserve.v1 import common_pb2, decode_pb2, generate_pb2, kv_events_pb2, prefill_pb2
from shared.engine.kv_cache.events import KvEvent, KvEventKind
from shared.engine.kv_transfer.handle import KvHandle, KvLayout, KvPullOutcome, KvPullStats
from shared.engine.kv_transfer.handle import KvRegion, KvSource
from shared.engine.request import DEFAULT_MAX_TOKENS, MODEL_DEFAULT_FIELDS, FinishReason, SamplingParams
from shared.engine.request import StructuredOutputSpec
from shared.engine.request import TokenLogprobs
from shared.serving.generation import MAX_REQUEST_ID_LENGTH, GenerateChunk, GenerateInput, check_request_id
from shared.serving.wire import (
    DecodeChunk, DecodeInput, KvEventUpdate, LoadReport, PrefillInput, PrefillKvSource, PrefillResult,
)

UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1
# A pod takes request ids twice a client's length, room for the suffixes the router adds to them.
MAX_POD_REQUEST_ID_LENGTH = 2 * MAX_REQUEST_ID_LENGTH


# ---- scalars and enums ------------------------------------------------------------------------


def _check_uint(name: str, value: int, limit: int = UINT32_MAX) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= limit:
        raise ValueError(f"{name} must be an integer in [0, {limit}], got {value!r}")
    return value


_FINISH_TO_PROTO = {
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
    FinishReason.ERROR: common_pb2.FINISH_REASON_ERROR,
}
_FINISH_FROM_PROTO = {v: k for k, v in _FINISH_TO_PROTO.items()}


def finish_reason_to_proto(reason: FinishReason | None) -> int:
    """None (not finished) maps to FINISH_REASON_UNSPECIFIED."""
    if reason is None:
        return common_pb2.FINISH_REASON_UNSPECIFIED
    if reason not in _FINISH_TO_PROTO:
        raise ValueError(f"not a FinishReason: {reason!r}")
    return _FINISH_TO_PROTO[reason]


def finish_reason_from_proto(value: int) -> FinishReason | None:
    """FINISH_REASON_UNSPECIFIED maps to None (not finished)."""
    if value == common_pb2.FINISH_REASON_UNSPECIFIED:
        return None
    if value not in _FINISH_FROM_PROTO:
        raise ValueError(f"unknown finish_reason enum value {value}")
    return _FINISH_FROM_PROTO[value]


_OUTCOME_TO_PROTO = {
    KvPullOutcome.PULLED: decode_pb2.KV_PULL_OUTCOME_PULLED,
    KvPullOutcome.PREFIX_CACHE_HIT: decode_pb2.KV_PULL_OUTCOME_PREFIX_CACHE_HIT,
    KvPullOutcome.RECOMPUTED_LEASE_EXPIRED: decode_pb2.KV_PULL_OUTCOME_RECOMPUTED_LEASE_EXPIRED,
    KvPullOutcome.RECOMPUTED_ERROR: decode_pb2.KV_PULL_OUTCOME_RECOMPUTED_ERROR,
    KvPullOutcome.RECOMPUTED_LAYOUT_MISMATCH: decode_pb2.KV_PULL_OUTCOME_RECOMPUTED_LAYOUT_MISMATCH,
    KvPullOutcome.NO_HANDLE: decode_pb2.KV_PULL_OUTCOME_NO_HANDLE,
}
_OUTCOME_FROM_PROTO = {v: k for k, v in _OUTCOME_TO_PROTO.items()}

_MEMORY_KIND_TO_PROTO = {"DRAM": prefill_pb2.MEMORY_KIND_DRAM, "VRAM": prefill_pb2.MEMORY_KIND_VRAM}
_MEMORY_KIND_FROM_PROTO = {v: k for k, v in _MEMORY_KIND_TO_PROTO.items()}


# ---- sampling params --------------------------------------------------------------------------


def sampling_params_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    """Fields in params.unset stay unset (the pod fills them from the model's defaults); an unset
    temperature or max_tokens travels as fallback_temperature or fallback_max_tokens."""
    message = common_pb2.SamplingParams(
        ignore_eos=params.ignore_eos,
        stop_token_ids=[_check_uint("stop_token_ids entry", t) for t in params.stop_token_ids],
        stop=list(params.stop),
        include_stop_str_in_output=params.include_stop_str_in_output,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        min_tokens=_check_uint("min_tokens", params.min_tokens),
        logit_bias={_check_uint("logit_bias key", token): bias for token, bias in params.logit_bias},
    )
    for name in sorted(MODEL_DEFAULT_FIELDS - params.unset):
        value = getattr(params, name)
        setattr(message, name, _check_uint(name, value) if name in ("top_k", "max_tokens") else value)
    if "temperature" in params.unset:
        message.fallback_temperature = params.temperature
    if "max_tokens" in params.unset and params.max_tokens != DEFAULT_MAX_TOKENS:
        message.fallback_max_tokens = _check_uint("max_tokens", params.max_tokens)
    if params.seed is not None:
        message.seed = _check_uint("seed", params.seed, UINT64_MAX)
    if params.prompt_logprobs is not None:
        message.prompt_logprobs = _check_uint("prompt_logprobs", params.prompt_logprobs)
    if params.logprobs is not None:
        message.logprobs = _check_uint("logprobs", params.logprobs)
    if params.n != 1:
        message.n = _check_uint("n", params.n)
    if params.structured_output is not None:
        message.structured_output.CopyFrom(_structured_output_to_proto(params.structured_output))
    return message


def _structured_output_to_proto(spec: StructuredOutputSpec) -> common_pb2.StructuredOutput:
    if spec.json_schema is not None:
        return common_pb2.StructuredOutput(json_schema=spec.json_schema)
    if spec.json_object:
        return common_pb2.StructuredOutput(json_object=True)
    if spec.regex is not None:
        return common_pb2.StructuredOutput(regex=spec.regex)
    return common_pb2.StructuredOutput(grammar=spec.grammar)


def _structured_output_from_proto(message: common_pb2.StructuredOutput) -> StructuredOutputSpec:
    kind = message.WhichOneof("kind")
    if kind is None or (kind == "json_object" and not message.json_object):
        raise ValueError("structured_output is set but names no constraint (json_schema, json_object, regex, grammar)")
    if kind != "json_object" and not getattr(message, kind):
        raise ValueError(f"structured_output.{kind} is empty")
    return StructuredOutputSpec(**{kind: getattr(message, kind)})


def sampling_params_from_proto(message: common_pb2.SamplingParams | None) -> SamplingParams:
    """Unset optional fields (or an absent message) take SamplingParams' defaults; those the model may
    give defaults for are marked unset (an unset temperature or max_tokens is fallback_temperature or
    fallback_max_tokens until then)."""
    if message is None:
        message = common_pb2.SamplingParams()
    kwargs: dict = {
        "ignore_eos": message.ignore_eos,
        "stop_token_ids": tuple(message.stop_token_ids),
        "stop": tuple(message.stop),
        "include_stop_str_in_output": message.include_stop_str_in_output,
        "presence_penalty": message.presence_penalty,
        "frequency_penalty": message.frequency_penalty,
        "min_tokens": message.min_tokens,
        "logit_bias": dict(message.logit_bias),
    }
    for name in ("seed", "logprobs", "prompt_logprobs", "n", *sorted(MODEL_DEFAULT_FIELDS)):
        if message.HasField(name):
            kwargs[name] = getattr(message, name)
    kwargs["unset"] = MODEL_DEFAULT_FIELDS - kwargs.keys()
    if "temperature" in kwargs["unset"]:
        kwargs["temperature"] = message.fallback_temperature
    if "max_tokens" in kwargs["unset"]:
        kwargs["max_tokens"] = message.fallback_max_tokens or DEFAULT_MAX_TOKENS
    floats = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
    not_numbers = [name for name in floats if name in kwargs and math.isnan(kwargs[name])]
    not_numbers += [f"logit_bias[{token}]" for token, bias in kwargs["logit_bias"].items() if math.isnan(bias)]
    if not_numbers:
        raise ValueError(f"sampling: {', '.join(not_numbers)} must be numbers, got NaN")
    try:
        if message.HasField("structured_output"):
            kwargs["structured_output"] = _structured_output_from_proto(message.structured_output)
        return SamplingParams(**kwargs)
    except ValueError as exc:
        raise ValueError(f"sampling: {exc}") from None


def token_logprobs_to_proto(entry: TokenLogprobs) -> common_pb2.TokenLogprobs:
    return common_pb2.TokenLogprobs(
        token_id=_check_uint("logprobs token_id", entry.token_id),
        logprob=entry.logprob,
        top=[common_pb2.TopLogprob(token_id=token, logprob=value) for token, value in entry.top],
    )


def token_logprobs_from_proto(message: common_pb2.TokenLogprobs) -> TokenLogprobs:
    return TokenLogprobs(
        message.token_id, message.logprob, tuple((top.token_id, top.logprob) for top in message.top)
    )


# ---- token ids ---------------------------------------------------------------------------------


def token_ids_from_proto(
    ids, *, name: str = "prompt_token_ids", vocab_size: int | None = None, allow_empty: bool = False
) -> list[int]:
    """Copies repeated uint32 ids into a list, checking emptiness and (if known) the vocabulary bound."""
    token_ids = list(ids)
    if not token_ids and not allow_empty:
        raise ValueError(f"{name} is empty")
    if vocab_size is not None:
        for index, token_id in enumerate(token_ids):
            if token_id >= vocab_size:
                raise ValueError(
                    f"{name}[{index}] = {token_id} is out of vocabulary (vocab_size {vocab_size})"
                )
    return token_ids


# ---- KV layout, handle, source ----------------------------------------------------------------


def kv_layout_to_proto(layout: KvLayout) -> common_pb2.KvLayout:
    return common_pb2.KvLayout(
        model_name=layout.model_name,
        dtype=layout.dtype,
        num_layers=_check_uint("layout.num_layers", layout.num_layers),
        num_kv_heads=_check_uint("layout.num_kv_heads", layout.num_kv_heads),
        head_dim=_check_uint("layout.head_dim", layout.head_dim),
        block_size=_check_uint("layout.block_size", layout.block_size),
    )


def kv_layout_from_proto(message: common_pb2.KvLayout) -> KvLayout:
    for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
        if getattr(message, name) == 0:
            raise ValueError(f"layout.{name} must be > 0")
    if not message.dtype:
        raise ValueError("layout.dtype is empty")
    return KvLayout(
        model_name=message.model_name,
        dtype=message.dtype,
        num_layers=message.num_layers,
        num_kv_heads=message.num_kv_heads,
        head_dim=message.head_dim,
        block_size=message.block_size,
    )


def kv_handle_to_proto(handle: KvHandle) -> common_pb2.KvHandle:
    return common_pb2.KvHandle(
        engine_id=handle.engine_id,
        source_address=handle.source_address,
        block_ids=[_check_uint("handle.block_ids entry", b) for b in handle.block_ids],
        num_tokens=_check_uint("handle.num_tokens", handle.num_tokens),
        block_size=_check_uint("handle.block_size", handle.block_size),
        layout=kv_layout_to_proto(handle.layout),
        lease_deadline_unix_ms=_check_uint("handle.lease_deadline_unix_ms", handle.lease_deadline_unix_ms, UINT64_MAX),
        prompt_digest=handle.prompt_digest,
        signature=handle.signature,
    )


def kv_handle_from_proto(message: common_pb2.KvHandle) -> KvHandle:
    if not message.engine_id:
        raise ValueError("handle.engine_id is empty")
    if not message.source_address:
        raise ValueError("handle.source_address is empty (expected host:port)")
    if not message.HasField("layout"):
        raise ValueError("handle.layout is missing")
    return KvHandle(
        engine_id=message.engine_id,
        source_address=message.source_address,
        block_ids=tuple(message.block_ids),
        num_tokens=message.num_tokens,
        block_size=message.block_size,
        layout=kv_layout_from_proto(message.layout),
        lease_deadline_unix_ms=message.lease_deadline_unix_ms,
        prompt_digest=message.prompt_digest,
        signature=message.signature,
    )


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


# ---- load and pull statistics -----------------------------------------------------------------


def load_report_to_proto(load: LoadReport) -> common_pb2.LoadReport:
    return common_pb2.LoadReport(
        num_waiting=_check_uint("num_waiting", load.num_waiting),
        num_running=_check_uint("num_running", load.num_running),
        num_free_blocks=_check_uint("num_free_blocks", load.num_free_blocks),
        num_total_blocks=_check_uint("num_total_blocks", load.num_total_blocks),
        num_held_blocks=_check_uint("num_held_blocks", load.num_held_blocks),
        is_overloaded=load.is_overloaded,
        max_model_len=_check_uint("max_model_len", load.max_model_len or 0),
        max_requests_in_flight=_check_uint("max_requests_in_flight", load.max_requests_in_flight or 0),
    )


def load_report_from_proto(message: common_pb2.LoadReport) -> LoadReport:
    return LoadReport(
        num_waiting=message.num_waiting,
        num_running=message.num_running,
        num_free_blocks=message.num_free_blocks,
        num_total_blocks=message.num_total_blocks,
        num_held_blocks=message.num_held_blocks,
        is_overloaded=message.is_overloaded,
        max_model_len=message.max_model_len or None,
        max_requests_in_flight=message.max_requests_in_flight or None,
    )


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


# ---- prefill and decode payloads --------------------------------------------------------------


def _request_id(value: str) -> str:
    if not value:
        raise ValueError("request_id is empty")
    return check_request_id(value, MAX_POD_REQUEST_ID_LENGTH)


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


def _resolved(sampling: SamplingParams) -> SamplingParams:
    """sampling, or ValueError when it leaves a field unset (resolved params name every field)."""
    if sampling.unset:
        raise ValueError(f"resolved_sampling leaves {', '.join(sorted(sampling.unset))} unset")
    return sampling


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


# ---- public Generate --------------------------------------------------------------------------


def generate_prompt_from_proto(message: generate_pb2.GenerateRequest) -> str | list[int]:
    """The prompt as text or token ids; ValueError when absent or empty."""
    kind = message.WhichOneof("prompt")
    if kind is None:
        raise ValueError("prompt is missing: set text or token_ids")
    if kind == "text":
        if not message.text:
            raise ValueError("prompt text is empty")
        return message.text
    return token_ids_from_proto(message.token_ids.ids, name="prompt token_ids")


def generate_input_from_proto(message: generate_pb2.GenerateRequest, timeout_s: float | None) -> GenerateInput:
    """The domain request of a Generate call (timeout_s: the call's deadline); ValueError saying what is wrong."""
    check_request_id(message.request_id)
    prompt = generate_prompt_from_proto(message)
    sampling = sampling_params_from_proto(message.sampling if message.HasField("sampling") else None)
    return GenerateInput(prompt, sampling, message.request_id, timeout_s)


def generate_chunk_to_proto(chunk: GenerateChunk) -> generate_pb2.GenerateResponse:
    return generate_pb2.GenerateResponse(
        request_id=chunk.request_id,
        token_ids=chunk.token_ids,
        text=chunk.text,
        finish_reason=finish_reason_to_proto(chunk.finish_reason),
        num_prompt_tokens=chunk.num_prompt_tokens,
        num_output_tokens=chunk.num_output_tokens,
        logprobs=[token_logprobs_to_proto(entry) for entry in chunk.logprobs],
        index=chunk.index,
        stop_string=chunk.stop_string,
        prompt_logprobs=[token_logprobs_to_proto(entry) for entry in chunk.prompt_logprobs],
    )


# ---- prefix-cache events --------------------------------------------------------------------------

_KV_EVENT_TO_PROTO = {
    KvEventKind.STORED: kv_events_pb2.KV_EVENT_KIND_STORED,
    KvEventKind.REMOVED: kv_events_pb2.KV_EVENT_KIND_REMOVED,
    KvEventKind.CLEARED: kv_events_pb2.KV_EVENT_KIND_CLEARED,
}
_KV_EVENT_FROM_PROTO = {v: k for k, v in _KV_EVENT_TO_PROTO.items()}
BLOCK_HASH_BYTES = 32


def kv_event_update_to_proto(update: KvEventUpdate) -> kv_events_pb2.SubscribeKvEventsResponse:
    return kv_events_pb2.SubscribeKvEventsResponse(
        engine_id=update.engine_id,
        block_size=update.block_size,
        root_hash=update.root_hash,
        is_snapshot=update.is_snapshot,
        events=[kv_events_pb2.KvEvent(kind=_KV_EVENT_TO_PROTO[e.kind], block_hash=e.block_hash) for e in update.events],
    )


def kv_event_update_from_proto(message: kv_events_pb2.SubscribeKvEventsResponse) -> KvEventUpdate:
    if not message.engine_id:
        raise ValueError("kv event update: engine_id is empty")
    if message.block_size < 1:
        raise ValueError("kv event update: block_size must be >= 1")
    if len(message.root_hash) != BLOCK_HASH_BYTES:
        raise ValueError(f"kv event update: root_hash must be {BLOCK_HASH_BYTES} bytes, got {len(message.root_hash)}")
    events = []
    for event in message.events:
        kind = _KV_EVENT_FROM_PROTO.get(event.kind)
        if kind is None:
            raise ValueError(f"kv event update: unknown event kind {event.kind}")
        expected = 0 if kind is KvEventKind.CLEARED else BLOCK_HASH_BYTES
        if len(event.block_hash) != expected:
            raise ValueError(f"kv event update: a {kind.value} event needs a {expected}-byte hash, "
                             f"got {len(event.block_hash)} bytes")
        events.append(KvEvent(kind, event.block_hash))
    return KvEventUpdate(message.engine_id, message.block_size, message.root_hash, message.is_snapshot, events)

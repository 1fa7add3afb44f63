"""The mapping of common.proto: scalars and enums, sampling params, token ids and logprobs, KV layouts and
handles, load reports. Every `*_from_proto` raises ValueError saying what is wrong (INVALID_ARGUMENT)."""
from __future__ import annotations

import math
from proto.pdserve.v1 import common_pb2
from shared.engine.kv_transfer.handle import KvHandle, KvLayout
from shared.engine.request import DEFAULT_MAX_TOKENS, MODEL_DEFAULT_FIELDS, FinishReason, SamplingParams
from shared.engine.request import StructuredOutputSpec
from shared.engine.request import TokenLogprobs
from shared.serving.generation import MAX_REQUEST_ID_LENGTH, check_request_id
from shared.serving.wire.payloads import LoadReport


UINT32_MAX = 2**32 - 1


UINT64_MAX = 2**64 - 1


# A pod takes request ids twice a client's length, room for the suffixes the router adds to them.
MAX_POD_REQUEST_ID_LENGTH = 2 * MAX_REQUEST_ID_LENGTH


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


def _request_id(value: str) -> str:
    if not value:
        raise ValueError("request_id is empty")
    return check_request_id(value, MAX_POD_REQUEST_ID_LENGTH)


def _resolved(sampling: SamplingParams) -> SamplingParams:
    """sampling, or ValueError when it leaves a field unset (resolved params name every field)."""
    if sampling.unset:
        raise ValueError(f"resolved_sampling leaves {', '.join(sorted(sampling.unset))} unset")
    return sampling

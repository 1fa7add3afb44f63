"""The wire mapping (shared/serving/wire) round-trips domain values through proto and rejects bad input with precise messages."""
import dataclasses

import pytest

from proto.pdserve.v1 import common_pb2, decode_pb2, generate_pb2, prefill_pb2
from shared.engine.kv_transfer.handle import KvHandle, KvLayout, KvPullOutcome, KvPullStats
from shared.serving.wire.common import (
    finish_reason_from_proto, finish_reason_to_proto, kv_handle_from_proto, kv_handle_to_proto, load_report_from_proto, load_report_to_proto, sampling_params_from_proto, sampling_params_to_proto, token_logprobs_from_proto, token_logprobs_to_proto,
)
from shared.serving.wire.decode import (
    decode_chunk_from_proto, decode_chunk_to_proto, decode_request_from_proto, decode_request_to_proto, kv_pull_stats_from_proto, kv_pull_stats_to_proto,
)
from shared.serving.generation import GenerateChunk
from shared.serving.wire.generate import (
    generate_chunk_from_proto, generate_chunk_to_proto, generate_prompt_from_proto,
)
from shared.serving.wire.prefill import (
    kv_source_from_proto, kv_source_to_proto, prefill_request_from_proto, prefill_request_to_proto, prefill_result_from_proto, prefill_result_to_proto,
)
from shared.serving.wire import payloads as wire
from shared.engine.kv_transfer.handle import KvRegion, KvSource
from shared.engine.request import MODEL_DEFAULT_FIELDS, FinishReason, SamplingParams, StructuredOutputSpec
from shared.engine.request import MAX_PROMPT_LOGPROBS, TokenLogprobs

LAYOUT = KvLayout("tiny", "float32", num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)


def make_handle(num_tokens=10, block_ids=(7, 3, 9)):
    return KvHandle("eng-1", "127.0.0.1:5000", block_ids, num_tokens, 4, LAYOUT, 1_700_000_000_000)


def test_sampling_params_round_trip():
    params = SamplingParams(max_tokens=33, ignore_eos=True, stop_token_ids=[5, 6], temperature=0.7,
                            top_k=40, top_p=0.9, seed=2**62)
    assert sampling_params_from_proto(sampling_params_to_proto(params)) == params


def test_prompt_logprobs_travel_and_are_bounded():
    message = sampling_params_to_proto(SamplingParams(prompt_logprobs=3))
    assert sampling_params_from_proto(message).prompt_logprobs == 3
    message.prompt_logprobs = MAX_PROMPT_LOGPROBS + 1
    with pytest.raises(ValueError, match="prompt_logprobs"):
        sampling_params_from_proto(message)


def test_sampling_params_defaults_when_unset():
    # Unset, the fields a model may give defaults for are marked so (the pod fills them).
    assert sampling_params_from_proto(common_pb2.SamplingParams()) == SamplingParams(unset=MODEL_DEFAULT_FIELDS)
    assert sampling_params_from_proto(None) == SamplingParams(unset=MODEL_DEFAULT_FIELDS)
    defaults = SamplingParams()
    message = sampling_params_to_proto(defaults)
    assert message.HasField("max_tokens") and not message.HasField("seed")
    # Explicit values travel with presence, 0 and 1 included: a pod can tell them from unset.
    assert all(message.HasField(name) for name in MODEL_DEFAULT_FIELDS)


def test_unset_max_tokens_travels_with_its_fallback():
    # The OpenAI front's chat falls back to the rest of the context, pdserve's gRPC to 16 (sent as 0).
    chat = SamplingParams(max_tokens=200, unset={"max_tokens"})
    message = sampling_params_to_proto(chat)
    assert not message.HasField("max_tokens") and message.fallback_max_tokens == 200
    assert sampling_params_from_proto(message) == chat
    silent = SamplingParams(unset={"max_tokens"})
    message = sampling_params_to_proto(silent)
    assert not message.HasField("max_tokens") and message.fallback_max_tokens == 0
    assert sampling_params_from_proto(message) == silent
    assert sampling_params_from_proto(common_pb2.SamplingParams(fallback_max_tokens=9)).max_tokens == 9


def test_unset_sampling_fields_round_trip_with_their_fallback():
    # The OpenAI front's unset temperature falls back to 1, pdserve's to 0; an explicit field is not unset.
    for fallback in (0.0, 1.0):
        params = SamplingParams(temperature=fallback, top_k=5, unset={"temperature", "top_p", "repetition_penalty"})
        message = sampling_params_to_proto(params)
        assert not message.HasField("temperature") and message.fallback_temperature == fallback
        assert message.HasField("top_k") and not message.HasField("top_p")
        assert sampling_params_from_proto(message) == params


@pytest.mark.parametrize(
    "fields, needle",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "NaN"),
        ({"temperature": 1e9}, "temperature"),
        ({"seed": 2**63}, "seed"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty must be numbers, got NaN"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
        ({"logit_bias": {7: 101.0}}, r"logit_bias\[7\]"),
        ({"logprobs": 21}, "logprobs"),
        ({"n": 0}, "n must be"),
        ({"n": 17}, "n must be"),
        ({"stop": [""]}, "stop strings"),
        ({"structured_output": common_pb2.StructuredOutput()}, "structured_output"),
        ({"structured_output": common_pb2.StructuredOutput(regex="")}, "structured_output.regex is empty"),
    ],
)
def test_bad_sampling_params_are_rejected(fields, needle):
    with pytest.raises(ValueError, match=needle):
        sampling_params_from_proto(common_pb2.SamplingParams(**fields))


def test_sampling_options_round_trip():
    params = SamplingParams(
        max_tokens=9, stop=("ab", "c d"), include_stop_str_in_output=True, presence_penalty=0.5,
        frequency_penalty=-0.25, repetition_penalty=1.3, min_tokens=2, logit_bias={5: 3.0, 2: -1.5},
        logprobs=3, n=4, seed=11, structured_output=StructuredOutputSpec(json_schema='{"type": "object"}'),
    )
    assert sampling_params_from_proto(sampling_params_to_proto(params)) == params
    for spec in (StructuredOutputSpec(json_object=True), StructuredOutputSpec(regex="[ab]+"),
                 StructuredOutputSpec(grammar="start: \"x\"")):
        with_spec = SamplingParams(structured_output=spec)
        assert sampling_params_from_proto(sampling_params_to_proto(with_spec)) == with_spec


def test_token_logprobs_round_trip():
    entry = TokenLogprobs(7, -0.5, ((7, -0.5), (3, -1.25)))
    assert token_logprobs_from_proto(token_logprobs_to_proto(entry)) == entry


def test_finish_reason_mapping_is_total_and_inverse():
    assert finish_reason_to_proto(None) == common_pb2.FINISH_REASON_UNSPECIFIED
    assert finish_reason_from_proto(common_pb2.FINISH_REASON_UNSPECIFIED) is None
    for reason in FinishReason:
        assert finish_reason_from_proto(finish_reason_to_proto(reason)) is reason
    with pytest.raises(ValueError, match="unknown finish_reason"):
        finish_reason_from_proto(99)


def test_kv_handle_round_trip_and_validation():
    handle = make_handle()
    assert kv_handle_from_proto(kv_handle_to_proto(handle)) == handle
    with pytest.raises(ValueError, match="need 3"):
        kv_handle_to_proto(make_handle(block_ids=(1, 2)))
    message = kv_handle_to_proto(handle)
    message.engine_id = ""
    with pytest.raises(ValueError, match="engine_id"):
        kv_handle_from_proto(message)
    message = kv_handle_to_proto(handle)
    message.block_size = 8
    with pytest.raises(ValueError, match="differs from handle.layout.block_size"):
        kv_handle_from_proto(message)
    message = kv_handle_to_proto(handle)
    message.ClearField("layout")
    with pytest.raises(ValueError, match="layout is missing"):
        kv_handle_from_proto(message)


def test_kv_source_round_trip_and_region_checks():
    regions = tuple(KvRegion(0x1000 * (i + 1), 4096, 0) for i in range(4))
    source = wire.PrefillKvSource("eng-1", LAYOUT, KvSource("agent-a", b"\x00meta", "DRAM", regions, 256, 16))
    assert kv_source_from_proto(kv_source_to_proto(source)) == source
    message = kv_source_to_proto(source)
    del message.regions[-1]
    with pytest.raises(ValueError, match="expected 2 per layer"):
        kv_source_from_proto(message)
    message = kv_source_to_proto(source)
    message.num_blocks = 17
    with pytest.raises(ValueError, match="smaller than"):
        kv_source_from_proto(message)
    with pytest.raises(ValueError, match="mem_type"):
        kv_source_to_proto(wire.PrefillKvSource("e", LAYOUT, KvSource("a", b"", "GPU", regions, 256, 16)))


def test_load_and_pull_stats_round_trip():
    load = wire.LoadReport(1, 2, 30, 64, 4, True)
    assert load_report_from_proto(load_report_to_proto(load)) == load
    stats = KvPullStats(4096, 3, 1, 0.25, KvPullOutcome.PULLED)
    assert kv_pull_stats_from_proto(kv_pull_stats_to_proto(stats)) == stats
    for outcome in KvPullOutcome:
        s = KvPullStats(0, 0, 0, 0.0, outcome)
        assert kv_pull_stats_from_proto(kv_pull_stats_to_proto(s)).outcome is outcome


def test_prefill_payloads():
    params = SamplingParams(max_tokens=4)
    message = prefill_request_to_proto("r1", [1, 2, 3], params)
    parsed = prefill_request_from_proto(message, vocab_size=10)
    assert (parsed.request_id, parsed.prompt_token_ids, parsed.sampling) == ("r1", [1, 2, 3], params)
    with pytest.raises(ValueError, match=r"prompt_token_ids\[2\] = 3 is out of vocabulary"):
        prefill_request_from_proto(message, vocab_size=3)
    with pytest.raises(ValueError, match="prompt_token_ids is empty"):
        prefill_request_from_proto(prefill_pb2.PrefillRequest(request_id="r"))
    with pytest.raises(ValueError, match="request_id is empty"):
        prefill_request_from_proto(prefill_pb2.PrefillRequest(prompt_token_ids=[1]))

    with_handle = wire.PrefillResult(5, 10, handle=make_handle())
    assert prefill_result_from_proto(prefill_result_to_proto(with_handle)) == with_handle
    finished = wire.PrefillResult(5, 10, finish_reason=FinishReason.STOP)
    assert prefill_result_from_proto(prefill_result_to_proto(finished)) == finished
    with pytest.raises(ValueError, match="exactly one"):
        prefill_result_to_proto(wire.PrefillResult(5, 10))
    with pytest.raises(ValueError, match="neither"):
        prefill_result_from_proto(prefill_pb2.PrefillResponse(first_token_id=1))


def test_prefill_result_carries_the_resolved_sampling():
    resolved = SamplingParams(max_tokens=24, temperature=0.0, top_k=5, top_p=0.8, repetition_penalty=1.1,
                              stop_token_ids=[9], seed=3, logprobs=2)
    result = wire.PrefillResult(5, 10, handle=make_handle(), resolved_sampling=resolved)
    message = prefill_result_to_proto(result)
    # Every field a model may default travels explicitly: decode has nothing left to fill.
    assert all(message.resolved_sampling.HasField(name) for name in MODEL_DEFAULT_FIELDS)
    assert prefill_result_from_proto(message) == result
    # An older prefill pod sends none: the router keeps the request's own params.
    message.ClearField("resolved_sampling")
    assert prefill_result_from_proto(message).resolved_sampling is None
    # Params still waiting for a model default are not resolved.
    unresolved = wire.PrefillResult(5, 10, handle=make_handle(), resolved_sampling=SamplingParams(unset={"top_p"}))
    with pytest.raises(ValueError, match="resolved_sampling leaves top_p unset"):
        prefill_result_to_proto(unresolved)
    message.resolved_sampling.CopyFrom(sampling_params_to_proto(SamplingParams(unset={"max_tokens"})))
    with pytest.raises(ValueError, match="resolved_sampling leaves max_tokens unset"):
        prefill_result_from_proto(message)


def test_decode_payloads():
    params = SamplingParams(max_tokens=8)
    work = wire.DecodeInput("r1", list(range(10)), [42], params, make_handle())
    assert decode_request_from_proto(decode_request_to_proto(work)) == work
    recompute = wire.DecodeInput("r1", list(range(10)), [42, 43, 44], params, None)
    assert decode_request_from_proto(decode_request_to_proto(recompute)) == recompute

    bad = decode_request_to_proto(work)
    bad.generated_token_ids.append(43)
    with pytest.raises(ValueError, match="exactly token 1"):
        decode_request_from_proto(bad)
    bad = decode_request_to_proto(work)
    bad.prompt_token_ids.append(1)
    with pytest.raises(ValueError, match="handle covers 10 tokens but the prompt has 11"):
        decode_request_from_proto(bad)
    # Exactly max_tokens generated is a complete request (the decode pod answers it so); more is wrong.
    done = wire.DecodeInput("r", [1], list(range(8)), params)
    assert decode_request_from_proto(decode_request_to_proto(done)) == done
    past = decode_request_to_proto(wire.DecodeInput("r", [1], list(range(9)), params))
    with pytest.raises(ValueError, match="9 tokens already generated exceed max_tokens 8"):
        decode_request_from_proto(past)
    # An unset max_tokens is the decode pod's to fill first (the checkpoint's may exceed the fallback).
    unfilled = wire.DecodeInput("r", [1], list(range(8)), SamplingParams(unset={"max_tokens"}))
    assert decode_request_from_proto(decode_request_to_proto(unfilled)) == unfilled

    # Prompt logprobs: only where this pod computes the prompt and nothing was generated yet.
    scoring = wire.DecodeInput("r", [1, 2], [], SamplingParams(max_tokens=8, prompt_logprobs=1))
    assert decode_request_from_proto(decode_request_to_proto(scoring)) == scoring
    for generated, handle in (([42], make_handle(num_tokens=2, block_ids=(7,))), ([42, 43], None)):
        bad = decode_request_to_proto(dataclasses.replace(scoring, generated_token_ids=generated, handle=handle))
        with pytest.raises(ValueError, match="prompt_logprobs are computed with the prompt"):
            decode_request_from_proto(bad)

    chunk = wire.DecodeChunk([1, 2], FinishReason.LENGTH,
                                KvPullStats(10, 1, 0, 0.1, KvPullOutcome.NO_HANDLE),
                                prompt_logprobs=[TokenLogprobs(2, -0.5, ((2, -0.5), (7, -1.5)))])
    assert decode_chunk_from_proto(decode_chunk_to_proto(chunk)) == chunk
    assert decode_chunk_from_proto(decode_pb2.DecodeResponse(token_ids=[3])) == wire.DecodeChunk([3])


def test_generate_chunk_round_trip():
    chunk = GenerateChunk("r", [5, 6], num_prompt_tokens=3, num_output_tokens=2, text="ab",
                          finish_reason=FinishReason.STOP, logprobs=[TokenLogprobs(5, -0.1, ((5, -0.1),)),
                                                                     TokenLogprobs(6, -0.2, ((6, -0.2),))],
                          index=1, stop_string="x", prompt_logprobs=[TokenLogprobs(2, -0.5, ((2, -0.5),))])
    assert generate_chunk_from_proto(generate_chunk_to_proto(chunk)) == chunk
    unfinished = GenerateChunk("r", [5], num_prompt_tokens=3, num_output_tokens=1)
    assert generate_chunk_from_proto(generate_chunk_to_proto(unfinished)) == unfinished


def test_generate_prompt():
    assert generate_prompt_from_proto(generate_pb2.GenerateRequest(text="hi")) == "hi"
    ids = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=[1, 2]))
    assert generate_prompt_from_proto(ids) == [1, 2]
    with pytest.raises(ValueError, match="prompt is missing"):
        generate_prompt_from_proto(generate_pb2.GenerateRequest())
    with pytest.raises(ValueError, match="prompt text is empty"):
        generate_prompt_from_proto(generate_pb2.GenerateRequest(text=""))
    with pytest.raises(ValueError, match="prompt token_ids is empty"):
        generate_prompt_from_proto(generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds()))

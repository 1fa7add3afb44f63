"""Sampling options in the engine: penalties, min_tokens, logit bias, output logprobs, grammars, stop
strings and n, and the property P/D relies on: an engine continuing a request from prompt + generated
tokens samples exactly what one engine running it from the start samples."""
from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest
import torch

from bpe_tokenizer import EOS_TOKEN_ID, bpe_tokenizer
from shared.engine.grammar import GrammarCompiler
from shared.engine.llm_engine import LLMEngine
from shared.engine.model.sampler import RowHistory, output_logprobs, process_logits, sample
from shared.engine.request import FinishReason, Request, SamplingParams, StructuredOutputSpec
from shared.engine.sched_config import CacheConfig, SchedulerConfig
from shared.serving import fan_out
from shared.serving.output_text import OutputText
from shared.serving.text import TextStream

PROMPT = [5, 6, 7, 8, 9, 10, 11]
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]}},
    "required": ["ok", "color"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine():
    engine = LLMEngine("tiny", SchedulerConfig(max_model_len=256), CacheConfig(block_size=16, num_blocks=128))
    engine.tokenizer = bpe_tokenizer()
    return engine


def assert_same_logprobs(actual, expected):
    assert [(e.token_id, [t for t, _ in e.top]) for e in actual] == [(e.token_id, [t for t, _ in e.top]) for e in expected]
    for a, e in zip(actual, expected):
        assert a.logprob == pytest.approx(e.logprob, abs=1e-4)
        assert [v for _, v in a.top] == pytest.approx([v for _, v in e.top], abs=1e-4)


def _history(tokens, output_start, stop=()):
    return RowHistory(tokens, output_start, len(tokens) - output_start, frozenset(stop))


# ---- sampler ------------------------------------------------------------------------------------


def test_penalties_follow_vllm_formulas():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0)
    # Token 0 in the prompt only; token 1 once and token 3 twice in the output.
    out = process_logits(logits, [0], [params], [_history([0, 1, 3, 3], output_start=1)])[0]
    expected = torch.tensor([2.0 / 2, -1.0 * 2 - 0.25 - 0.5, 0.5, 3.0 / 2 - 0.5 - 0.5, -2.0])
    torch.testing.assert_close(out, expected)
    assert torch.equal(logits, torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])), "the input logits are untouched"


def test_only_rows_that_ask_are_processed():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(), SamplingParams(logit_bias={7: 100.0}), SamplingParams()]
    histories = [None, _history([1, 2], 2), None]
    tokens = sample(logits, params, [0, 0, 0], [2, 2, 2], histories)
    assert tokens[1] == 7
    assert tokens[0] == int(logits[0].argmax()) and tokens[2] == int(logits[2].argmax())


def test_min_tokens_holds_back_eos_and_stop_tokens():
    logits = torch.zeros(1, 10)
    logits[0, 4] = 5.0  # EOS would win
    logits[0, 6] = 4.0  # then the stop token
    params = SamplingParams(min_tokens=2, stop_token_ids=[6])
    history = RowHistory([1, 2], 2, 0, frozenset({4, 6}))
    assert sample(logits, [params], [0], [2], [history]) not in ([4], [6])
    done = RowHistory([1, 2, 3, 3], 2, 2, frozenset({4, 6}))
    assert sample(logits, [params], [0], [4], [done]) == [4]


def test_output_logprobs_are_the_raw_log_softmax():
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(1))
    entries = output_logprobs(logits, [3, 4], [2, 0])
    expected = torch.log_softmax(logits, dim=-1)
    assert entries[0].token_id == 3 and entries[0].logprob == pytest.approx(float(expected[0, 3]))
    top = expected[0].topk(2)
    assert [t for t, _ in entries[0].top] == top.indices.tolist()
    assert entries[1].top == ()


# ---- engine: continuing a request equals running it whole (what the decode pod relies on) ------


@pytest.mark.parametrize("options", [
    dict(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3),
    dict(temperature=0.8, seed=7, frequency_penalty=1.0),
    dict(min_tokens=6, logit_bias={EOS_TOKEN_ID: 30.0}),
    dict(logprobs=3),
])
@pytest.mark.slow
def test_continued_request_samples_like_the_whole_request(engine, options):
    params = SamplingParams(max_tokens=10, **options)
    [whole] = engine.generate([PROMPT], params)
    assert len(whole.token_ids) > 4
    for split_at in (1, 4):
        generated = whole.token_ids[:split_at]
        continued = SamplingParams(
            max_tokens=10 - split_at, **{**options, "min_tokens": max(0, options.get("min_tokens", 0) - split_at)}
        )
        request = Request(f"continue-{split_at}", PROMPT + generated, continued, engine.eos_token_id,
                          num_prior_output_tokens=split_at)
        engine.add_request(request)
        tokens, logprobs = [], []
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens.extend(out.new_token_ids)
                logprobs.extend(out.new_logprobs or ())
        assert generated + tokens == whole.token_ids
        if options.get("logprobs"):
            # Same tokens; values agree up to float32 rounding (a prompt chunk and a decode step
            # compute the same logits with differently shaped matmuls).
            assert_same_logprobs(logprobs, whole.logprobs[split_at:])


def test_min_tokens_and_penalties_change_the_output(engine):
    [plain] = engine.generate([PROMPT], SamplingParams(max_tokens=10, ignore_eos=True))
    [penalized] = engine.generate([PROMPT], SamplingParams(max_tokens=10, ignore_eos=True, frequency_penalty=2.0))
    assert len(set(plain.token_ids)) < len(set(penalized.token_ids))
    [eos_first] = engine.generate([PROMPT], SamplingParams(max_tokens=5, logit_bias={EOS_TOKEN_ID: 100.0}))
    assert eos_first.token_ids == [EOS_TOKEN_ID]
    [held] = engine.generate([PROMPT], SamplingParams(max_tokens=5, min_tokens=3, logit_bias={EOS_TOKEN_ID: 100.0}))
    assert held.token_ids[:3] != [EOS_TOKEN_ID] * 3 and held.token_ids[3] == EOS_TOKEN_ID


# ---- structured output --------------------------------------------------------------------------


def test_json_schema_output_parses_and_validates(engine):
    spec = StructuredOutputSpec(json_schema=json.dumps(SCHEMA))
    outputs = engine.generate(
        [PROMPT, [3, 4]], [SamplingParams(max_tokens=40, structured_output=spec),
                           SamplingParams(max_tokens=40, temperature=1.0, seed=5, structured_output=spec)]
    )
    for out in outputs:
        assert out.finish_reason.value == "stop" and out.token_ids[-1] == EOS_TOKEN_ID
        jsonschema.validate(json.loads(engine.tokenizer.decode(out.token_ids)), SCHEMA)


def test_regex_and_grammar_constrain_the_output(engine):
    [regex] = engine.generate([PROMPT], SamplingParams(max_tokens=30, structured_output=StructuredOutputSpec(
        regex="(ab|cd){2,4}x")))
    text = engine.tokenizer.decode(regex.token_ids)
    assert text.endswith("x") and set(text[:-1]) <= set("abcd")
    lark = 'start: "yes" | "no"'
    [grammar] = engine.generate([PROMPT], SamplingParams(max_tokens=10, structured_output=StructuredOutputSpec(
        grammar=lark)))
    assert engine.tokenizer.decode(grammar.token_ids) in ("yes", "no")


def test_bad_constraints_are_rejected_with_the_reason():
    compiler = GrammarCompiler(bpe_tokenizer(), 4096, [EOS_TOKEN_ID])
    with pytest.raises(ValueError, match="json_schema is not valid JSON"):
        compiler.compile(StructuredOutputSpec(json_schema="{not json"))
    with pytest.raises(ValueError, match="structured output"):
        compiler.compile(StructuredOutputSpec(regex="(unclosed"))
    grammar = compiler.compile(StructuredOutputSpec(regex="[a-z]+"))
    assert not grammar.accept_tokens("r", [bpe_tokenizer().token_to_id("{")])
    assert grammar.error


@pytest.mark.e2e  # llguidance's lexer works on a{1000000} for seconds before it gives up
def test_a_constraint_whose_lexer_gives_up_fails_every_request_that_uses_it():
    # Compiles, but llguidance's lexer gives up at the first token; the copies share that lexer, so
    # a later request must fail too (not be let through with EOS as its whole output).
    compiler = GrammarCompiler(bpe_tokenizer(), 4096, [EOS_TOKEN_ID])
    spec = StructuredOutputSpec(regex="a{1000000}")
    for _ in range(2):
        grammar = compiler.compile(spec)
        allowed = grammar.allowed_tokens(4096).nonzero().flatten().tolist()
        assert not grammar.accept_tokens("r", allowed[:1])
        assert "lexer" in grammar.error


def test_deeply_nested_json_schema_is_refused_by_name():
    compiler = GrammarCompiler(bpe_tokenizer(), 4096, [EOS_TOKEN_ID])
    with pytest.raises(ValueError, match="nests too deeply"):
        compiler.compile(StructuredOutputSpec(json_schema="[" * 5000 + "]" * 5000))


def test_a_repeated_constraint_starts_fresh_for_each_request():
    """Requests with the same schema share its compiled grammar, never each other's progress."""
    compiler = GrammarCompiler(bpe_tokenizer(), 4096, [EOS_TOKEN_ID])
    spec = StructuredOutputSpec(json_object=True)
    first = compiler.compile(spec)
    at_start = first.allowed_tokens(4096)
    assert first.accept_tokens("r1", [int(at_start.nonzero()[0])])
    assert not torch.equal(first.allowed_tokens(4096), at_start)
    second = compiler.compile(spec)
    assert torch.equal(second.allowed_tokens(4096), at_start)
    for n in range(GrammarCompiler.CACHED_GRAMMARS + 1):  # the cache stays bounded
        compiler.compile(StructuredOutputSpec(regex=f"x{n}"))
    assert len(compiler._start_states) == GrammarCompiler.CACHED_GRAMMARS


def test_structured_output_needs_a_tokenizer():
    engine = LLMEngine("tiny", SchedulerConfig(max_model_len=64), CacheConfig(block_size=16, num_blocks=16))
    engine.tokenizer = None  # a model directory without tokenizer.json
    spec = StructuredOutputSpec(json_object=True)
    with pytest.raises(ValueError, match="tokenizer"):
        engine.add_request(Request("r", PROMPT, SamplingParams(structured_output=spec), engine.eos_token_id))


# ---- stop strings -------------------------------------------------------------------------------


def _pieces(tokenizer, words):
    return [tokenizer.token_to_id(w) for w in words]


def test_stop_string_split_across_tokens_is_cut_like_vllm():
    tokenizer = bpe_tokenizer()
    ids = tokenizer.encode("the quick brown fox jumps").ids
    text = OutputText(TextStream(tokenizer), SamplingParams(stop=("k bro",)))
    delta = text.push(ids, None)
    assert delta.stop_string == "k bro"
    assert delta.text == "the quic"
    completed_at = next(i for i in range(len(ids)) if "k bro" in tokenizer.decode(ids[:i + 1]))
    assert delta.token_ids == ids[:completed_at + 1], "the token that completed the stop is the last one kept"
    kept = OutputText(TextStream(tokenizer), SamplingParams(stop=("k bro",), include_stop_str_in_output=True))
    assert kept.push(ids, None).text == "the quick bro"


def test_streamed_text_holds_back_a_possible_stop_prefix():
    tokenizer = bpe_tokenizer()
    ids = tokenizer.encode("the lazy dog").ids
    text = OutputText(TextStream(tokenizer), SamplingParams(stop=("dogs",)))
    streamed = "".join(text.push([token], None).text for token in ids)
    assert streamed == "the lazy dog"[:len(streamed)] and len(streamed) <= len("the lazy dog") - 3
    assert streamed + text.push([], FinishReason.LENGTH).text == "the lazy dog"


def test_a_stop_token_ends_the_text_without_its_own_text_like_vllm():
    # A stop token (here a plain word, as an EOS that is not a special token would be) is counted and
    # sent as a token id, but its text is not added, unless include_stop_str_in_output.
    tokenizer = bpe_tokenizer()
    ids = tokenizer.encode("the lazy dog").ids
    text = OutputText(TextStream(tokenizer), SamplingParams())
    delta = text.push(ids, FinishReason.STOP)
    assert delta.token_ids == ids and delta.text == tokenizer.decode(ids[:-1])
    kept = OutputText(TextStream(tokenizer), SamplingParams(include_stop_str_in_output=True))
    assert kept.push(ids, FinishReason.STOP).text == "the lazy dog"
    assert OutputText(TextStream(tokenizer), SamplingParams()).push(ids, FinishReason.LENGTH).text == "the lazy dog"


def test_stop_strings_wait_for_min_tokens():
    tokenizer = bpe_tokenizer()
    ids = tokenizer.encode("the the the").ids
    text = OutputText(TextStream(tokenizer), SamplingParams(stop=("the",), min_tokens=2, max_tokens=5))
    delta = text.push(ids, None)
    assert delta.stop_string == "the" and len(delta.token_ids) > 2


def test_stop_strings_without_a_tokenizer_are_refused():
    with pytest.raises(ValueError, match="tokenizer"):
        OutputText(None, SamplingParams(stop=("x",)))


# ---- n ------------------------------------------------------------------------------------------


def test_children_get_derived_seeds():
    params = SamplingParams(n=3, seed=10, temperature=1.0)
    assert [fan_out.child_params(params, i).seed for i in range(3)] == [10, 11, 12]
    assert fan_out.child_params(SamplingParams(n=2), 1).seed is None
    assert all(fan_out.child_params(params, i).n == 1 for i in range(3))


def test_merge_interleaves_and_fails_fast():
    async def stream(index):
        for step in range(3):
            await asyncio.sleep(0)
            yield (index, step)

    async def failing(index):
        yield index
        if index == 1:
            raise RuntimeError("child 1 failed")
        await asyncio.sleep(10)

    async def run():
        items = [item async for item in fan_out.merge(stream, 3)]
        assert sorted(items) == [(i, s) for i in range(3) for s in range(3)]
        with pytest.raises(RuntimeError, match="child 1"):
            async for _ in fan_out.merge(failing, 3):
                pass

    asyncio.run(asyncio.wait_for(run(), 5))


def _allows_text_after(compiler: GrammarCompiler, schema: dict, prefix: str, follow: str) -> bool:
    """Whether the schema's grammar takes `follow` right after `prefix` (both encoded by the test tokenizer)."""
    tokenizer = bpe_tokenizer()
    grammar = compiler.compile(StructuredOutputSpec(json_schema=json.dumps(schema, separators=(",", ":"))))
    assert grammar.accept_tokens("r", tokenizer.encode(prefix, add_special_tokens=False).ids)
    return grammar.accept_tokens("r", tokenizer.encode(follow, add_special_tokens=False).ids)


def test_a_schema_silent_on_additional_properties_takes_no_undeclared_keys():
    """vLLM's default backend: declared properties and nothing else, unless the schema says otherwise
    (here at the top and in a nested object alike)."""
    compiler = GrammarCompiler(bpe_tokenizer(), 4096, [EOS_TOKEN_ID])
    city = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    assert not _allows_text_after(compiler, city, '{"city":"Paris"', ',"country":"FR"}')
    assert _allows_text_after(compiler, city, '{"city":"Paris"', "}")
    nested = {"type": "object", "properties": {"place": city}, "required": ["place"]}
    assert not _allows_text_after(compiler, nested, '{"place":{"city":"Paris"', ',"x":1')
    assert _allows_text_after(compiler, {**city, "additionalProperties": True}, '{"city":"Paris"', ',"country":"FR"}')
    assert _allows_text_after(compiler, {**city, "additionalProperties": {"type": "integer"}}, '{"city":"Paris"',
                              ',"zip":75}')

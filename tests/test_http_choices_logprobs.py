"""n choices, logprobs and chat's default max_tokens over the OpenAI HTTP front, driven by the official
`openai` client against the split system (router + prefill + decode processes, the shared cluster) and
the colocated server (in process): OpenAI's response shapes, streamed and not, and the split system
giving the colocated server's tokens and logprobs."""
from __future__ import annotations

import asyncio
import math

import openai
import pytest

from shared.engine.request import MAX_LOGPROBS
from shared.serving.text import TextCodec
from test_http_api import MAX_MODEL_LEN, PROMPT, _all_free, _wait_pods_idle, _wait_until, colocated_http

pytestmark = pytest.mark.e2e

SPLIT_MAX_MODEL_LEN = 2048  # the tiny preset's, which the shared cluster serves
MESSAGES = [{"role": "user", "content": "Name three colours."}]
TOP = 3
# (endpoint, arguments): each runs streamed and not, on both systems. Seeded, so sampled choices repeat.
REQUESTS = [
    ("completions", dict(prompt=PROMPT, n=3, max_tokens=6, temperature=1.0, seed=5, extra_body={"ignore_eos": True})),
    ("chat", dict(messages=MESSAGES, n=3, max_tokens=6, temperature=1.0, seed=7, extra_body={"ignore_eos": True})),
    ("completions", dict(prompt=PROMPT, logprobs=TOP, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})),
    ("chat", dict(messages=MESSAGES, logprobs=True, top_logprobs=TOP, max_tokens=8, temperature=0,
                  extra_body={"ignore_eos": True})),
    ("chat", dict(messages=MESSAGES, n=2, logprobs=True, top_logprobs=2, max_tokens=5, temperature=1.0, seed=3,
                  extra_body={"ignore_eos": True})),
]


async def _create(client: openai.AsyncOpenAI, endpoint: str, stream: bool, **kwargs):
    create = client.chat.completions.create if endpoint == "chat" else client.completions.create
    if stream:
        kwargs["stream_options"] = {"include_usage": True}
    return await create(model="tiny", stream=stream, **kwargs)


async def _result(client: openai.AsyncOpenAI, endpoint: str, stream: bool, **kwargs) -> dict:
    """Per choice index: text, finish reason and logprobs (token, logprob, top tokens), plus the usage;
    a streamed answer reassembled and its shape checked on the way."""
    answer = await _create(client, endpoint, stream, **kwargs)
    choices: dict[int, dict] = {}
    if not stream:
        for choice in answer.choices:
            entry = choices.setdefault(choice.index, _empty())
            entry["text"] = choice.message.content if endpoint == "chat" else choice.text
            entry["finish"] = choice.finish_reason
            _add_logprobs(entry, endpoint, choice.logprobs)
        return {"choices": choices, "usage": answer.usage.model_dump()}
    chunks = [chunk async for chunk in answer]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None, "the usage chunk comes last"
    assert all(chunk.usage is None for chunk in chunks[:-1])
    for chunk in chunks[:-1]:
        [choice] = chunk.choices  # one choice per event, named by its index
        is_first = choice.index not in choices
        entry = choices.setdefault(choice.index, _empty())
        assert entry["finish"] is None, "nothing follows a choice's finish"
        if endpoint == "chat":
            assert (choice.delta.role == "assistant") == is_first, "the role comes with a choice's first delta"
            entry["text"] += choice.delta.content or ""
        else:
            entry["text"] += choice.text
        entry["finish"] = choice.finish_reason
        _add_logprobs(entry, endpoint, choice.logprobs)
    return {"choices": choices, "usage": chunks[-1].usage.model_dump()}


def _empty() -> dict:
    return {"text": "", "finish": None, "tokens": [], "logprobs": [], "tops": [], "offsets": []}


def _add_logprobs(entry: dict, endpoint: str, logprobs) -> None:
    if logprobs is None:
        return
    if endpoint == "chat":
        for item in logprobs.content:
            # A whole character's token: its text's UTF-8; part of one: its own bytes (its text is U+FFFD).
            assert item.bytes == list(item.token.encode("utf-8")) or item.token == "\ufffd"
            entry["tokens"].append(item.token)
            entry["logprobs"].append(item.logprob)
            entry["tops"].append([(top.token, top.logprob) for top in item.top_logprobs])
        return
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs)
    entry["tokens"] += logprobs.tokens
    entry["logprobs"] += logprobs.token_logprobs
    entry["tops"] += [list(top.items()) for top in logprobs.top_logprobs]
    entry["offsets"] += logprobs.text_offset


def _check_shape(endpoint: str, kwargs: dict, result: dict) -> None:
    n = kwargs.get("n", 1)
    choices = result["choices"]
    assert sorted(choices) == list(range(n))
    assert all(choice["finish"] == "length" for choice in choices.values())
    usage = result["usage"]
    # The prompt counts once, every choice's tokens count.
    assert usage["completion_tokens"] == n * kwargs["max_tokens"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    if n > 1:
        assert len({choice["text"] for choice in choices.values()}) > 1, "each choice samples with its own seed"
    wants_logprobs = kwargs.get("logprobs") not in (None, False)
    for choice in choices.values():
        if not wants_logprobs:
            assert choice["tokens"] == []
            continue
        assert len(choice["tokens"]) == kwargs["max_tokens"]
        assert all(value <= 0 for value in choice["logprobs"])
        if endpoint == "completions":
            # vLLM's completions logprobs: the chosen token, then the most likely ones; offsets add up.
            assert all(top[0] == (token, value) and len(top) <= TOP + 1
                       for token, value, top in zip(choice["tokens"], choice["logprobs"], choice["tops"]))
            tokens = choice["tokens"]
            assert choice["offsets"] == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
        else:
            assert all(len(top) == kwargs["top_logprobs"] for top in choice["tops"])
            assert all([v for _, v in top] == sorted((v for _, v in top), reverse=True) for top in choice["tops"])
        if kwargs["temperature"] == 0:  # greedy: the chosen token is the most likely one
            assert all(math.isclose(value, max(v for _, v in top))
                       for value, top in zip(choice["logprobs"], choice["tops"]))


def _assert_same(split: dict, whole: dict) -> None:
    """Same text, tokens and top tokens; logprobs within 1e-4."""
    assert split["usage"] == whole["usage"]
    assert sorted(split["choices"]) == sorted(whole["choices"])
    for index, expected in whole["choices"].items():
        got = split["choices"][index]
        for key in ("text", "finish", "tokens", "offsets"):
            assert got[key] == expected[key], (index, key)
        assert got["logprobs"] == pytest.approx(expected["logprobs"], abs=1e-4)
        assert [[t for t, _ in top] for top in got["tops"]] == [[t for t, _ in top] for top in expected["tops"]]
        for got_top, expected_top in zip(got["tops"], expected["tops"]):
            assert [v for _, v in got_top] == pytest.approx([v for _, v in expected_top], abs=1e-4)


def test_n_and_logprobs_split_equals_colocated_streamed_and_not(split_cluster):
    async def scenario():
        async with colocated_http() as (colocated, pod, _):
            async with openai.AsyncOpenAI(base_url=split_cluster.router.http_url, api_key="unused",
                                          max_retries=0) as split:
                for endpoint, kwargs in REQUESTS:
                    results = {}
                    for name, client in (("split", split), ("colocated", colocated)):
                        for stream in (False, True):
                            results[name, stream] = await _result(client, endpoint, stream, **kwargs)
                            _check_shape(endpoint, kwargs, results[name, stream])
                    whole = results["colocated", False]
                    for result in results.values():
                        _assert_same(result, whole)
            await _wait_until(lambda: _all_free(pod))

    asyncio.run(scenario())
    _wait_pods_idle(split_cluster)


def _messages_leaving(codec: TextCodec, max_model_len: int, rest: int) -> tuple[list[dict], int]:
    """Chat messages whose prompt leaves about `rest` tokens of the model's length; and its length."""
    def length(num_words: int) -> int:
        return len(codec.encode_chat([{"role": "user", "content": "colour " * num_words}]))

    per_word = (length(200) - length(100)) / 100
    num_words = int((max_model_len - rest - length(0)) / per_word)
    while length(num_words) > max_model_len - rest:
        num_words -= 1
    messages = [{"role": "user", "content": "colour " * num_words}]
    return messages, length(num_words)


async def _check_chat_default_max_tokens(client: openai.AsyncOpenAI, max_model_len: int) -> None:
    """No max_tokens: the completion may use the rest of the model's length, as in vLLM (not 16)."""
    messages, num_prompt_tokens = _messages_leaving(TextCodec.from_path("tiny"), max_model_len, rest=40)
    assert max_model_len - num_prompt_tokens > 16
    chat = await client.chat.completions.create(model="tiny", messages=messages, temperature=0,
                                                extra_body={"ignore_eos": True})
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage.prompt_tokens == num_prompt_tokens
    assert chat.usage.total_tokens == max_model_len
    # Completions keep vLLM's default of 16.
    completion = await client.completions.create(model="tiny", prompt=PROMPT, temperature=0,
                                                 extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == 16


def test_chat_default_max_tokens_is_the_rest_of_the_context(split_cluster):
    async def scenario():
        async with colocated_http() as (colocated, pod, _):
            await _check_chat_default_max_tokens(colocated, MAX_MODEL_LEN)
            await _wait_until(lambda: _all_free(pod))
        async with openai.AsyncOpenAI(base_url=split_cluster.router.http_url, api_key="unused", max_retries=0) as split:
            await _check_chat_default_max_tokens(split, SPLIT_MAX_MODEL_LEN)

    asyncio.run(scenario())
    _wait_pods_idle(split_cluster)


def test_logprobs_fields_are_checked_as_openai_does(split_cluster):
    async def scenario():
        async with colocated_http() as (colocated, _, _):
            async with openai.AsyncOpenAI(base_url=split_cluster.router.http_url, api_key="unused",
                                          max_retries=0) as split:
                for client in (colocated, split):
                    for kwargs, needle in ((dict(top_logprobs=2), "top_logprobs needs logprobs: true"),
                                           (dict(logprobs=True, top_logprobs=MAX_LOGPROBS + 1),
                                            f"top_logprobs must be in [0, {MAX_LOGPROBS}]"),
                                           (dict(logprobs=True, top_logprobs=-1), "top_logprobs must be in")):
                        for stream in (False, True):
                            with pytest.raises(openai.BadRequestError) as info:
                                await client.chat.completions.create(
                                    model="tiny", messages=MESSAGES, max_tokens=4, stream=stream, **kwargs)
                            assert needle in info.value.body["message"]
                            assert info.value.body["type"] == "invalid_request_error"

    asyncio.run(scenario())


ECHO = dict(prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2, echo=True, extra_body={"ignore_eos": True})


async def _echoed(client: openai.AsyncOpenAI, stream: bool, **kwargs) -> dict:
    """A one-choice completion's text and logprobs (tokens, token_logprobs, top_logprobs, text_offset)."""
    answer = await client.completions.create(model="tiny", stream=stream, **kwargs)
    choices = [answer.choices[0]] if not stream else [chunk.choices[0] async for chunk in answer]
    result = {"text": "", "tokens": [], "logprobs": [], "tops": [], "offsets": []}
    for choice in choices:
        result["text"] += choice.text
        if choice.logprobs is not None:
            result["tokens"] += choice.logprobs.tokens
            result["logprobs"] += choice.logprobs.token_logprobs
            result["tops"] += choice.logprobs.top_logprobs
            result["offsets"] += choice.logprobs.text_offset
    return result


def test_echo_gives_the_prompt_and_its_logprobs_before_the_completion(split_cluster):
    """echo (with logprobs) answers the prompt's text and its tokens' logprobs (the first has none) before
    the completion's, as vLLM does, split as colocated, streamed or not; max_tokens 0 answers the prompt alone."""
    plain_request = {**ECHO, "echo": False}

    async def scenario():
        async with colocated_http() as (colocated, pod, _):
            async with openai.AsyncOpenAI(base_url=split_cluster.router.http_url, api_key="unused",
                                          max_retries=0) as split:
                plain = await _echoed(colocated, False, **plain_request)
                num_prompt_tokens = len(TextCodec.from_path("tiny").encode(PROMPT))
                answers = {(name, stream): await _echoed(client, stream, **ECHO)
                           for name, client in (("split", split), ("colocated", colocated)) for stream in (False, True)}
                echoed = answers["colocated", False]
                assert echoed["text"] == PROMPT + plain["text"]
                assert len(echoed["tokens"]) == num_prompt_tokens + 4
                assert echoed["tokens"][num_prompt_tokens:] == plain["tokens"]
                assert echoed["logprobs"][num_prompt_tokens:] == pytest.approx(plain["logprobs"], abs=1e-5)
                assert echoed["logprobs"][0] is None and echoed["tops"][0] is None
                for token, value, top in zip(echoed["tokens"][1:], echoed["logprobs"][1:], echoed["tops"][1:]):
                    assert value <= 0 and list(top.items())[0] == (token, value) and len(top) <= 3
                assert echoed["offsets"] == [sum(map(len, echoed["tokens"][:i])) for i in range(len(echoed["tokens"]))]
                for answer in answers.values():
                    assert (answer["text"], answer["tokens"], answer["offsets"]) == \
                        (echoed["text"], echoed["tokens"], echoed["offsets"])
                    assert answer["logprobs"][1:] == pytest.approx(echoed["logprobs"][1:], abs=1e-4)
                for client in (split, colocated):
                    alone = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True,
                                                            logprobs=2, temperature=0)
                    assert alone.choices[0].text == PROMPT and alone.usage.completion_tokens == 0
                    assert alone.choices[0].logprobs.tokens == echoed["tokens"][:num_prompt_tokens]
                    by_ids = await client.completions.create(
                        model="tiny", prompt=TextCodec.from_path("tiny").encode(PROMPT), max_tokens=2, echo=True)
                    assert by_ids.choices[0].text.startswith(PROMPT)
                    with pytest.raises(openai.BadRequestError, match="'echo'"):
                        await client.chat.completions.create(model="tiny", messages=MESSAGES, extra_body={"echo": True})
            await _wait_until(lambda: _all_free(pod))

    asyncio.run(scenario())
    _wait_pods_idle(split_cluster)


def test_a_batch_of_prompts_answers_each_prompts_choices_in_order(split_cluster):
    """prompt as a list (texts or token ids): prompt i's n completions are choices i*n .. i*n+n-1, each what
    that prompt alone gives; usage counts every prompt once. Split as colocated, streamed or not."""
    codec = TextCodec.from_path("tiny")
    prompts = ["The router", codec.encode("streams tokens"), "from the decode pod"]
    options = dict(max_tokens=4, temperature=0, n=2, extra_body={"ignore_eos": True})

    async def scenario():
        async with colocated_http() as (colocated, pod, _):
            async with openai.AsyncOpenAI(base_url=split_cluster.router.http_url, api_key="unused",
                                          max_retries=0) as split:
                alone = [(await colocated.completions.create(model="tiny", prompt=prompt, **options))
                         for prompt in prompts]
                expected = [choice.text for answer in alone for choice in answer.choices]
                num_prompt_tokens = sum(answer.usage.prompt_tokens for answer in alone)
                for client in (split, colocated):
                    whole = await client.completions.create(model="tiny", prompt=prompts, **options)
                    assert [choice.index for choice in whole.choices] == list(range(6))
                    assert [choice.text for choice in whole.choices] == expected
                    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (num_prompt_tokens, 24)
                    stream = await client.completions.create(model="tiny", prompt=prompts, stream=True,
                                                             stream_options={"include_usage": True}, **options)
                    texts = [""] * 6
                    async for chunk in stream:
                        for choice in chunk.choices:
                            texts[choice.index] += choice.text
                        usage = chunk.usage
                    assert texts == expected and usage.prompt_tokens == num_prompt_tokens
                    echoed = await client.completions.create(model="tiny", prompt=prompts[::2], echo=True, max_tokens=0)
                    assert [choice.text for choice in echoed.choices] == prompts[::2]
            await _wait_until(lambda: _all_free(pod))

    asyncio.run(scenario())
    _wait_pods_idle(split_cluster)

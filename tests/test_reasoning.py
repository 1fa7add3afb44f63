"""A reasoning model's <think>...</think> read apart from its answer, whole and streamed in pieces, with
thinking opened by the model or already by the prompt's template."""
from __future__ import annotations

import random

import pytest

from shared.serving.openai.reasoning import ReasoningStream, prompt_opens_thinking, split_reasoning

CASES = [
    # (output, prompt opened <think>, reasoning, content)
    ("<think>\nCompare digits.\n</think>\n\n9.8 is larger.", False, "\nCompare digits.\n", "\n\n9.8 is larger."),
    ("  <think>a < b</think>yes", False, "a < b", "yes"),
    ("Compare digits.\n</think>\n\n9.8", True, "Compare digits.\n", "\n\n9.8"),  # DeepSeek-R1: prompt opened it
    ("Still thinking when cut", True, "Still thinking when cut", ""),
    ("<think>Again.</think>9.8", True, "Again.", "9.8"),  # the model opened it once more: left out, as vLLM
    ("<think>cut short <", False, "cut short <", ""),
    ("Plain answer, no <think> here", False, None, "Plain answer, no <think> here"),
    ("<thin", False, None, "<thin"),
    ("", False, None, ""),
]


@pytest.mark.parametrize("text, opens, reasoning, content", CASES)
def test_thinking_is_read_apart_whole_and_streamed_alike(text, opens, reasoning, content):
    assert split_reasoning(text, opens) == (reasoning, content)
    rng = random.Random(1)
    for _ in range(20):
        stream, streamed_reasoning, streamed_content, at = ReasoningStream(opens), "", "", 0
        while at < len(text):
            size = rng.randint(1, 5)
            piece = stream.push(text[at:at + size])
            at += size
            streamed_reasoning += piece.reasoning
            streamed_content += piece.content
        end = stream.finish()
        assert (streamed_reasoning + end.reasoning, streamed_content + end.content) == (reasoning or "", content)
        assert stream.did_think == (reasoning is not None)


def test_reasoning_streams_as_it_comes_and_waits_only_on_a_possible_tag():
    stream = ReasoningStream(False)
    assert (stream.push("<thi").reasoning, stream.push("nk>Let me").reasoning) == ("", "Let me")
    assert stream.push(" see </th").reasoning == " see "
    piece = stream.push("ink>Answer")
    assert (piece.reasoning, piece.content) == ("", "Answer")


def test_the_prompts_end_tells_whether_thinking_is_open():
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # Qwen3, thinking off
    assert not prompt_opens_thinking("<|im_start|>assistant\n")

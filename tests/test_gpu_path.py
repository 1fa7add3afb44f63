"""The CUDA path on a real GPU (skipped without one; scripts/gpu_check.sh runs -m gpu): the compiled Triton
kernels against the float64 reference at the presets' head_dim, CUDA-graph replay equal to eager
steps, greedy and seeded tokens on the tiny preset identical to the CPU path, seeded draws on the GPU
independent of the batch, the 8B preset built on the GPU. Kept small: the GPU check gives all its
tests 150 s, Triton compiles included."""
from __future__ import annotations

import random

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from shared.engine.model.attention import TRITON  # noqa: E402
from shared.engine.request import SamplingParams  # noqa: E402
from shared.engine.sched_config import CacheConfig, SchedulerConfig  # noqa: E402

if torch.cuda.is_available():
    pytest.importorskip("triton")
    from test_triton_attention import check_decode, check_spans


@pytest.mark.parametrize("dtype,num_splits", [(torch.bfloat16, None), (torch.bfloat16, 5), (torch.float32, 1)])
def test_decode_kernel_on_gpu(dtype, num_splits):
    check_decode([1, 17, 300, 1025], num_heads=32, num_kv_heads=8, block_size=16, dtype=dtype,
                 num_splits=num_splits, block_n=64, device="cuda", head_dim=128)
    check_decode([3, 600], num_heads=8, num_kv_heads=2, block_size=16, dtype=dtype, window=128,
                 num_splits=num_splits, block_n=64, device="cuda", head_dim=128)


@pytest.mark.parametrize("dtype,window", [(torch.bfloat16, None), (torch.bfloat16, 100), (torch.float32, None)])
def test_prefill_kernel_on_gpu(dtype, window):
    check_spans([(300, 300), (65, 400), (1, 30), (128, 128)], num_heads=32, num_kv_heads=8, block_size=16,
                dtype=dtype, window=window, block_m=None, block_n=64, device="cuda", head_dim=128)


@pytest.fixture(autouse=True)
def no_cpu_kernel_build(monkeypatch):
    """The CPU reference takes the gather + SDPA path: building the C++ decode kernel on a fresh GPU
    machine would spend the test budget."""
    from shared.engine.model import runner

    monkeypatch.setattr(runner, "paged_decode_available", lambda *args: False)


def _engine(device, cuda_graphs, dtype="float32"):
    from shared.engine.llm_engine import LLMEngine

    scheduler = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=1024, max_model_len=1024)
    return LLMEngine("tiny", scheduler, CacheConfig(block_size=16, num_blocks=1024), device=device, dtype=dtype,
                     cuda_graphs=cuda_graphs)


def _prompts(count, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(4096) for _ in range(rng.randrange(4, 200))] for _ in range(count)]


def _run(engine, prompts, params):
    outputs = engine.generate(prompts, params)
    return [out.token_ids for out in outputs], [[entry.logprob for entry in out.logprobs] for out in outputs]


def test_graph_replay_equals_eager_steps():
    prompts = _prompts(37)
    params = [SamplingParams(max_tokens=12 + i % 9, ignore_eos=True, temperature=0.0 if i % 3 else 0.7, seed=i,
                             logprobs=1) for i in range(len(prompts))]
    graphs = _engine("cuda", cuda_graphs=True)
    assert graphs.runner.attention_backend == TRITON and graphs.runner.decode_graphs is not None
    replayed = _run(graphs, prompts, params)
    assert graphs.runner.decode_graphs._graphs  # some steps were replays
    eager = _run(_engine("cuda", cuda_graphs=False), prompts, params)
    assert replayed[0] == eager[0]
    for got, want in zip(replayed[1], eager[1]):
        assert got == pytest.approx(want, abs=1e-4)


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_greedy_tokens_on_gpu_match_the_cpu_path(cuda_graphs):
    prompts = _prompts(8, seed=1)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    cpu = _engine("cpu", cuda_graphs=False).generate(prompts, params)
    gpu = _engine("cuda", cuda_graphs=cuda_graphs).generate(prompts, params)
    assert [out.token_ids for out in gpu] == [out.token_ids for out in cpu]


def test_seeded_draws_on_the_gpu_are_batch_independent():
    """Random rows are drawn on the logits' device, each from its own row and (seed, position) alone."""
    from shared.engine.model.sampler import sample

    logits = torch.randn(64, 128256, device="cuda", generator=torch.Generator("cuda").manual_seed(0)) * 4
    params = [SamplingParams(temperature=0.7 + 0.01 * i, top_p=0.9 if i % 2 else 1.0, top_k=50 if i % 3 == 0 else 0)
              for i in range(64)]
    batch = sample(logits, params, list(range(64)), [5] * 64)
    alone = [sample(logits[i:i + 1], [params[i]], [i], [5])[0] for i in range(64)]
    assert batch == alone


def test_seeded_samples_match_the_cpu_path():
    """Seeded draws use only per-row arithmetic, so the GPU's tokens equal the CPU path's on tiny."""
    prompts = _prompts(4, seed=2)
    params = [SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.8, top_p=0.9, seed=100 + i)
              for i in range(len(prompts))]
    cpu = _engine("cpu", cuda_graphs=False).generate(prompts, params)
    gpu = _engine("cuda", cuda_graphs=True).generate(prompts, params)
    assert [out.token_ids for out in gpu] == [out.token_ids for out in cpu]


def test_llama3_8b_builds_on_the_gpu_in_bfloat16():
    from shared.engine.model.loader import load_model

    torch.cuda.reset_peak_memory_stats()
    loaded = load_model("llama3-8b", device="cuda")
    params = list(loaded.model.parameters())
    assert all(p.device.type == "cuda" and p.dtype == torch.bfloat16 for p in params)
    assert sum(p.numel() for p in params) == 8_030_261_248
    del loaded
    torch.cuda.empty_cache()

"""The GPU path's parts that need no GPU: the attention backend the runner picks, the decode graphs'
batch-size buckets, padding and static buffers (run eagerly on the CPU: same tokens as the plain
path), and the llama3-8b preset's shapes (on the meta device: nothing allocated)."""
from __future__ import annotations

import random

import pytest
import torch

from shared.engine.sched_config import CacheConfig, SchedulerConfig
from shared.engine.llm_engine import LLMEngine
from shared.engine.model import attention
from shared.engine.model.attention import AttentionMetadata, select_attention_backend
from shared.engine.model.cuda_graphs import PAD_SLOT, DecodeInputs, padded_batch_size
from shared.engine.model.llama import LlamaModel, rope_inverse_frequencies
from shared.engine.model.loader import load_model
from shared.engine.model.model_config import LARGE_PRESETS, ModelArchConfig, preset
from shared.engine.request import SamplingParams


def test_backend_choice():
    choose = select_attention_backend
    assert choose("cuda", triton_available=True, cpu_kernel_available=False) == attention.TRITON
    assert choose("cuda", triton_available=False, cpu_kernel_available=False) == attention.GATHER_SDPA
    assert choose("cpu", triton_available=True, cpu_kernel_available=True) == attention.CPU_DECODE_KERNEL
    assert choose("cpu", triton_available=True, cpu_kernel_available=False) == attention.GATHER_SDPA


def test_cpu_runner_keeps_its_path_and_has_no_graphs_by_default():
    engine = _engine(cuda_graphs=None)
    runner = engine.runner
    assert runner.attention_backend in (attention.CPU_DECODE_KERNEL, attention.GATHER_SDPA)
    assert not runner._uses_triton
    assert runner.decode_graphs is None


def test_padded_batch_size_buckets():
    sizes = (1, 2, 4, 8, 16, 24, 32)
    assert [padded_batch_size(n, sizes) for n in (1, 2, 3, 5, 16, 17, 25, 32)] == [1, 2, 4, 8, 16, 24, 32, 32]
    assert padded_batch_size(33, sizes) is None


def test_decode_inputs_fill_pads_and_keeps_real_rows():
    inputs = DecodeInputs(max_batch_size=8, max_blocks_per_seq=6, device=torch.device("cpu"))
    inputs.block_table.fill_(9)  # stale ids from an earlier, wider step
    inputs.context_lens.fill_(50)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([17, 42, 5]), num_decode_tokens=3,
        decode_block_table=torch.tensor([[4, 0], [10, 11], [1, 0]]), decode_context_lens=torch.tensor([2, 7, 2]),
        decode_key_mask=None, spans=[],
    )
    inputs.fill(torch.tensor([101, 102, 103]), torch.tensor([1, 6, 1]), meta, batch_size=4)
    view = inputs.metadata(4, use_triton=True)
    assert view.num_decode_tokens == 4 and view.use_triton and not view.spans
    assert inputs.input_ids[:4].tolist() == [101, 102, 103, 0]
    assert inputs.positions[:4].tolist() == [1, 6, 1, 0]
    assert view.slot_mapping.tolist() == [17, 42, 5, PAD_SLOT]
    assert view.decode_context_lens.tolist() == [2, 7, 2, 1]
    # Real rows: this step's ids in front, stale ids past the step's width (never read); padding: block 0.
    assert view.decode_block_table.tolist() == [[4, 0, 9, 9, 9, 9], [10, 11, 9, 9, 9, 9], [1, 0, 9, 9, 9, 9],
                                                [0] * 6]
    # The views share the buffers a captured graph reads.
    assert view.decode_block_table.data_ptr() == inputs.block_table.data_ptr()
    too_wide = AttentionMetadata(slot_mapping=torch.tensor([0]), num_decode_tokens=1,
                                 decode_block_table=torch.zeros(1, 7, dtype=torch.long),
                                 decode_context_lens=torch.tensor([1]), decode_key_mask=None, spans=[])
    with pytest.raises(ValueError, match="exceeds"):
        inputs.fill(torch.tensor([1]), torch.tensor([0]), too_wide, batch_size=1)


SMALL = ModelArchConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                        num_kv_heads=2, max_position_embeddings=256, eos_token_id=None, bos_token_id=None)


def _engine(cuda_graphs, batch_sizes=None):
    from shared.engine.model.loader import random_model, LoadedModel
    from shared.engine.model.generation_config import generation_defaults

    loaded = LoadedModel(SMALL, random_model(SMALL, seed=5), None, generation_defaults((), None))
    scheduler = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256, max_model_len=256)
    engine = LLMEngine(loaded, scheduler, CacheConfig(block_size=8, num_blocks=128), cuda_graphs=cuda_graphs)
    if batch_sizes is not None and engine.runner.decode_graphs is not None:
        engine.runner.decode_graphs.batch_sizes = batch_sizes
    return engine


def _generate(engine, prompts, params):
    """Each request's tokens and their logprobs (a random tiny model's tokens barely depend on position:
    the logprobs show a wrong position or a padding row leaking in)."""
    outputs = engine.generate(prompts, params)
    return [out.token_ids for out in outputs], [[entry.logprob for entry in out.logprobs] for out in outputs]


def _assert_same(actual, expected):
    assert actual[0] == expected[0]
    for got, want in zip(actual[1], expected[1]):
        assert got == pytest.approx(want, abs=1e-5)


def test_static_buffer_decodes_match_the_plain_path():
    """The graphs' padded static-buffer forward (eager on the CPU) gives the same greedy and seeded tokens
    as the plain path, with 11 requests padded to 16 and then fewer as they finish; a bucket list
    smaller than the batch sends the first steps eagerly."""
    rng = random.Random(0)
    prompts = [[rng.randrange(300) for _ in range(rng.randrange(3, 40))] for _ in range(11)]
    params = [SamplingParams(max_tokens=6 + i, ignore_eos=True, temperature=0.0 if i % 2 else 0.8, seed=i, logprobs=1)
              for i in range(11)]
    expected = _generate(_engine(cuda_graphs=False), prompts, params)
    graphs = _engine(cuda_graphs=True, batch_sizes=(1, 2, 4, 8))
    runs = []
    original = graphs.runner.decode_graphs.run
    graphs.runner.decode_graphs.run = lambda ids, pos, meta: runs.append(ids.shape[0]) or original(ids, pos, meta)
    _assert_same(_generate(graphs, prompts, params), expected)
    assert runs and max(runs) <= 8
    assert any(n not in (1, 2, 4, 8) for n in runs)  # padded batches ran on the buffers
    _assert_same(_generate(_engine(cuda_graphs=True), prompts, params), expected)


def test_llama3_8b_preset_has_the_checkpoint_shapes():
    config = preset("llama3-8b")
    assert "llama3-8b" in LARGE_PRESETS
    assert config.dtype == "bfloat16" and config.head_dim == 128
    assert (config.hidden_size, config.intermediate_size, config.num_layers, config.num_heads,
            config.num_kv_heads, config.vocab_size, config.max_position_embeddings) == (
        4096, 14336, 32, 32, 8, 128256, 131072)
    assert config.rope_theta == 500000.0 and config.rope_scaling["rope_type"] == "llama3"
    model = LlamaModel(config, device="meta")  # shapes only: nothing is allocated
    num_params = sum(p.numel() for p in model.parameters())
    assert num_params == 8_030_261_248  # Llama-3.1-8B's parameter count
    assert all(p.device.type == "meta" for p in model.parameters())
    # The llama3 rope scaling slows the long wavelengths by 8 and keeps the short ones.
    inv_freq = rope_inverse_frequencies(config)
    plain = 1.0 / (500000.0 ** (torch.arange(0, 128, 2).float() / 128))
    assert torch.equal(inv_freq[:10], plain[:10])
    torch.testing.assert_close(inv_freq[-1], plain[-1] / 8)


def test_large_presets_build_on_the_target_device(monkeypatch):
    """load_model builds a large preset on the device it will run on (no CPU copy), the others on the CPU."""
    from shared.engine.model import loader

    built_on = []
    monkeypatch.setattr(loader, "random_model", lambda config, seed, device="cpu": built_on.append(str(device)))
    monkeypatch.setattr(loader, "LARGE_PRESETS", frozenset({"tiny"}))
    load_model("tiny", device="meta")
    monkeypatch.setattr(loader, "LARGE_PRESETS", frozenset())
    load_model("tiny", device="meta")
    assert built_on == ["meta", "cpu"]


def test_padding_rows_write_only_the_pad_slot_and_read_one_key():
    inputs = DecodeInputs(max_batch_size=4, max_blocks_per_seq=3, device=torch.device("cpu"))
    inputs.input_ids.fill_(5)
    inputs.slot_mapping.fill_(77)
    inputs.block_table.fill_(3)
    inputs.pad(1, 4)
    assert inputs.input_ids.tolist() == [5, 0, 0, 0]
    assert inputs.slot_mapping.tolist() == [77, PAD_SLOT, PAD_SLOT, PAD_SLOT]
    assert inputs.block_table.tolist() == [[3, 3, 3], [0, 0, 0], [0, 0, 0], [0, 0, 0]]
    assert inputs.context_lens.tolist()[1:] == [1, 1, 1]

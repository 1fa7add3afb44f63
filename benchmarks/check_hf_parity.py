"""The project's bfloat16 rule on a real checkpoint: the engine's prefill logits bit-identical to
transformers' (SDPA attention, its default), and its greedy tokens transformers' own, or first
different at a step where transformers' logits for the two tokens are within one bfloat16 step.

    python benchmarks/check_hf_parity.py --model /path/to/SmolLM2-135M-Instruct [--prompts 8] [--threads 2]
"""
from __future__ import annotations

import argparse
import math
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shared.engine.llm_engine import LLMEngine  # noqa: E402
from shared.engine.request import SamplingParams  # noqa: E402
from shared.engine.sched_config import CacheConfig, SchedulerConfig  # noqa: E402


def bfloat16_step(value: float) -> float:
    return math.ldexp(1.0, math.frexp(abs(value))[1] - 8)


def hf_reference(model: str, prompts: list[list[int]], num_output: int, dtype: torch.dtype):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model, attn_implementation="sdpa", dtype=dtype).eval()
    references = []
    with torch.no_grad():
        for prompt in prompts:
            out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=num_output, min_new_tokens=num_output, do_sample=False,
                              pad_token_id=0, output_logits=True, return_dict_in_generate=True)
            references.append((out.sequences[0, len(prompt):].tolist(), [s[0].float() for s in out.logits]))
    return references


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 40_000) for _ in range(rng.randrange(5, 130))] for _ in range(args.prompts)]
    references = hf_reference(args.model, prompts, args.output_len, getattr(torch, args.dtype))
    engine = LLMEngine(args.model, SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=8192, max_model_len=512),
                       CacheConfig(block_size=16, num_blocks=512), dtype=args.dtype, num_threads=args.threads)
    calls = []
    compute_logits = engine.loaded.model.compute_logits
    engine.loaded.model.compute_logits = lambda h: calls.append(compute_logits(h)) or calls[-1]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0))
    failures = 0
    for index, (output, (tokens, logits)) in enumerate(zip(outputs, references)):
        prefill_equal = torch.equal(calls[0][index], logits[0])
        first = next((i for i, (a, b) in enumerate(zip(output.token_ids, tokens)) if a != b), None)
        verdict = "same tokens"
        if first is not None:
            mine, its = logits[first][output.token_ids[first]].item(), logits[first][tokens[first]].item()
            tie = bfloat16_step(max(abs(mine), abs(its)))
            verdict = (f"first different at {first}: {its - mine:.4g} apart, "
                       f"{'a tie' if its - mine <= tie else 'NOT a tie'} (one step {tie:.4g})")
            failures += its - mine > tie
        failures += not prefill_equal
        max_diff = (calls[0][index] - logits[0]).abs().max().item()
        print(f"prompt {index} ({len(prompts[index])} tokens): prefill logits "
              f"{'bit-identical' if prefill_equal else f'DIFFER (max {max_diff:.4g})'}; {verdict}")
    print("PASS" if not failures else f"FAIL ({failures})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

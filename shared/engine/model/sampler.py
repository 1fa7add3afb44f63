"""Token sampling (greedy, temperature, top-k, top-p) with randomness derived from (seed, position),
and prompt logprobs.

A seeded request draws its noise from a generator seeded by mixing its seed with the position of the
token being sampled, so it samples the same tokens in any process, on any pod and in any batch.
"""
from __future__ import annotations

import torch

from shared.engine.request import SamplingParams

_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, position: int) -> int:
    """A 63-bit generator seed from (seed, position): splitmix64 finalisers, stable across processes."""
    x = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    for _ in range(2):
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
        x ^= x >> 31
    return x >> 1


def sample(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
           positions: list[int]) -> list[int]:
    """One token per row of float32 logits [N, V]. positions[i]: the index the sampled token will take
    in its request's sequence; seeds[i]: the request's seed (the runner fills one in when unseeded)."""
    tokens = logits.argmax(dim=-1).tolist()
    for row, p in enumerate(params):
        if not p.is_greedy:
            tokens[row] = sample_row(logits[row], p, seeds[row], positions[row])
    return tokens


def sample_row(logits: torch.Tensor, params: SamplingParams, seed: int, position: int) -> int:
    """Exponential-race sampling (argmax of p / E, E ~ Exp(1)) over the filtered distribution.
    Runs on the CPU whatever the logits' device, so a seeded request samples the same token anywhere."""
    probs = filtered_probs(logits.cpu(), params)
    generator = torch.Generator().manual_seed(mix_seed(seed, position))
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / noise).argmax())


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Softmax of logits / temperature restricted to the top-k tokens, then to the top-p nucleus."""
    scaled = logits / params.temperature
    if params.top_k and params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it does.
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop = mass_before >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum()
    return probs


def prompt_logprobs(logits: torch.Tensor, next_token_ids: torch.Tensor, num_top: int) -> list[dict[int, float]]:
    """For each row i: logprob of next_token_ids[i] (the prompt token that follows) plus the num_top most
    likely tokens, as {token_id: logprob}. Raw model distribution: no temperature or filtering."""
    logprobs = torch.log_softmax(logits, dim=-1)
    actual = logprobs.gather(-1, next_token_ids.unsqueeze(-1)).squeeze(-1).tolist()
    ids = next_token_ids.tolist()
    entries = [{token: value} for token, value in zip(ids, actual)]
    if num_top:
        top_values, top_ids = logprobs.topk(num_top, dim=-1)
        for entry, row_ids, row_values in zip(entries, top_ids.tolist(), top_values.tolist()):
            for token, value in zip(row_ids, row_values):
                entry.setdefault(token, value)
    return entries

"""Token sampling (greedy, temperature, top-k, top-p) with randomness derived from (seed, position);
logits processing (logit bias, min_tokens, presence/frequency/repetition penalties, grammar masks);
prompt and output logprobs.

A seeded request draws its noise from a generator seeded by mixing its seed with the position of the
token being sampled, so it samples the same tokens in any process, on any pod and in any batch.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shared.engine.request import SamplingParams, TokenLogprobs

_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, position: int) -> int:
    """A 63-bit generator seed from (seed, position): splitmix64 finalisers, stable across processes."""
    x = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    for _ in range(2):
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
        x ^= x >> 31
    return x >> 1


@dataclass(frozen=True, slots=True)
class RowHistory:
    """What a row's logits processing reads besides its params: every token before the sampled position
    (prompt, then output from index output_start), the output tokens this engine sampled (what
    min_tokens counts), the ids min_tokens holds back, and a grammar mask."""

    token_ids: Sequence[int]
    output_start: int
    num_sampled_tokens: int
    stop_token_ids: frozenset[int]
    allowed: torch.Tensor | None = None  # bool [V]: the tokens a grammar allows here


def sample(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
           positions: list[int], histories: list[RowHistory | None] | None = None) -> list[int]:
    """One token per row of float32 logits [N, V]. positions[i]: the index the sampled token will take
    in its request's sequence; seeds[i]: the request's seed (the runner fills one in when unseeded);
    histories[i]: needed for the rows whose params process logits."""
    rows = [i for i, p in enumerate(params) if p.processes_logits]
    if rows:
        logits = process_logits(logits, rows, [params[i] for i in rows], [histories[i] for i in rows])
    tokens = logits.argmax(dim=-1).tolist()
    random_rows = [row for row, p in enumerate(params) if not p.is_greedy]
    if random_rows:
        # The draws run on the CPU (sample_row): one device-to-host copy for all rows, not a sync per row.
        on_host = logits if logits.device.type == "cpu" else logits[random_rows].cpu()
        for i, row in enumerate(random_rows):
            row_logits = on_host[row] if on_host is logits else on_host[i]
            tokens[row] = sample_row(row_logits, params[row], seeds[row], positions[row])
    return tokens


def process_logits(logits: torch.Tensor, rows: list[int], params: list[SamplingParams],
                   histories: list[RowHistory]) -> torch.Tensor:
    """A copy of logits with the given rows processed, in vLLM's order: grammar mask, logit bias,
    min_tokens, then penalties."""
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    picked = logits.index_select(0, index).float()
    masked = [row for row, history in enumerate(histories) if history.allowed is not None]
    if masked:
        allowed = torch.stack([histories[row].allowed for row in masked])
        if len(masked) == len(rows):
            picked.masked_fill_(~allowed, float("-inf"))
        else:
            picked[masked] = picked[masked].masked_fill(~allowed, float("-inf"))
    penalized = []
    for row, (p, history) in enumerate(zip(params, histories)):
        if p.logit_bias:
            ids = [token for token, _ in p.logit_bias if token < picked.shape[-1]]
            biases = [bias for token, bias in p.logit_bias if token < picked.shape[-1]]
            picked[row, ids] += torch.tensor(biases, dtype=picked.dtype, device=picked.device)
        if history.num_sampled_tokens < p.min_tokens and history.stop_token_ids:
            picked[row, list(history.stop_token_ids)] = float("-inf")
        if p.has_penalties:
            penalized.append(row)
    if penalized:
        picked[penalized] = _apply_penalties(
            picked[penalized], [params[r] for r in penalized], [histories[r] for r in penalized]
        )
    out = logits.clone()
    out.index_copy_(0, index, picked.to(out.dtype))
    return out


def _apply_penalties(logits: torch.Tensor, params: list[SamplingParams], histories: list[RowHistory]) -> torch.Tensor:
    """Repetition over prompt and output tokens, then frequency and presence over output tokens (vLLM's)."""
    num_rows, vocab = logits.shape
    device = logits.device
    output_counts = torch.zeros(num_rows, vocab, device=device)
    seen = torch.zeros(num_rows, vocab, dtype=torch.bool, device=device)
    for row, history in enumerate(histories):
        ids = torch.tensor(list(history.token_ids), dtype=torch.long, device=device)
        seen[row, ids] = True
        output = ids[history.output_start:]
        output_counts[row].scatter_add_(0, output, torch.ones_like(output, dtype=output_counts.dtype))
    column = lambda name: torch.tensor([getattr(p, name) for p in params], device=device).unsqueeze(1)  # noqa: E731
    repetition = column("repetition_penalty")
    repeated = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, repeated, logits)
    logits = logits - column("frequency_penalty") * output_counts
    return logits - column("presence_penalty") * (output_counts > 0)


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


def output_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: list[int]) -> list[TokenLogprobs]:
    """Per row: the sampled token's logprob and the num_top[row] most likely tokens, from the raw model
    distribution (before penalties, temperature and filtering, as vLLM reports by default)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(-1, torch.tensor(token_ids, device=logits.device).unsqueeze(-1)).squeeze(-1).tolist()
    most = max(num_top, default=0)
    top_values = top_ids = None
    if most:
        top_values, top_ids = (t.tolist() for t in logprobs.topk(most, dim=-1))
    entries = []
    for row, token_id in enumerate(token_ids):
        k = num_top[row]
        top = tuple(zip(top_ids[row][:k], top_values[row][:k])) if k else ()
        entries.append(TokenLogprobs(token_id, chosen[row], top))
    return entries

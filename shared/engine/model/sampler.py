"""Token sampling (greedy, temperature, top-k, top-p) with randomness derived from (seed, position);
logits processing (logit bias, min_tokens, presence/frequency/repetition penalties, grammar masks);
prompt and output logprobs.

A random row draws its token by inverse transform: one uniform number, made from the request's seed
mixed with the position of the token being sampled, picks a point of the row's filtered distribution.
Every step of that is per row (elementwise, or a reduction along the row's own vocabulary), so a
seeded request samples the same token in any process, on any pod and in any batch, and all the random
rows of a step are drawn at once, on the logits' device.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shared.engine.request import SamplingParams, TokenLogprobs

_MASK64 = (1 << 64) - 1
# Top-p looks for the nucleus among this many most likely tokens first (a language model's usually lies
# there), and sorts the whole vocabulary only for the rows whose nucleus does not.
_NUCLEUS_CANDIDATES = 1024


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
        picked = logits if len(random_rows) == len(params) else logits[random_rows]
        drawn = draw(picked, [params[row] for row in random_rows], [uniform(seeds[row], positions[row])
                                                                    for row in random_rows])
        for row, token in zip(random_rows, drawn):
            tokens[row] = token
    return tokens


def uniform(seed: int, position: int) -> float:
    """The request's uniform number in [0, 1) for the token at this position (52 bits: u * total < total
    in float64 for any total, so the draw never falls past the last token)."""
    return (mix_seed(seed, position) >> 11) / float(1 << 52)


def draw(logits: torch.Tensor, params: list[SamplingParams], uniforms: list[float]) -> list[int]:
    """One token per row of logits [R, V]: the first whose cumulative filtered probability exceeds
    uniforms[r] times the row's total (tokens filtered out have probability 0 and are never drawn)."""
    cdf = filtered_probs(logits, params).double().cumsum(dim=-1)
    targets = torch.tensor(uniforms, dtype=torch.float64, device=logits.device) * cdf[:, -1]
    tokens = torch.searchsorted(cdf, targets.unsqueeze(1), right=True).squeeze(1)
    return tokens.clamp_(max=logits.shape[-1] - 1).tolist()


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
    """Repetition over prompt and output tokens, then frequency and presence over output tokens (vLLM's).
    Only the tokens a row has seen change, so each row touches those alone (O(context), not O(vocab))."""
    device = logits.device
    for row, (p, history) in enumerate(zip(params, histories)):
        ids = torch.tensor(list(history.token_ids), dtype=torch.long, device=device)
        seen, index_in_seen = torch.unique(ids, return_inverse=True)
        output = index_in_seen[history.output_start:]
        counts = torch.zeros(len(seen), device=device).scatter_add_(0, output, torch.ones(len(output), device=device))
        repetition, frequency, presence = (torch.tensor(value, device=device) for value in
                                           (p.repetition_penalty, p.frequency_penalty, p.presence_penalty))
        values = logits[row, seen]
        values = torch.where(values > 0, values / repetition, values * repetition)
        values = values - frequency * counts
        logits[row, seen] = values - presence * (counts > 0)
    return logits


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Per row of logits [R, V]: the softmax of logits / temperature restricted to the tokens min_p keeps,
    then to the top-k tokens, then to the top-p nucleus (vLLM's order). Not renormalised (the draw scales
    by each row's total): a sum over a row may be split across threads when it is the only row, and its
    rounding would then depend on the batch."""
    vocab = logits.shape[-1]
    device = logits.device
    temperatures = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
    scaled = logits.float() / temperatures.unsqueeze(1)
    if any(p.min_p > 0.0 for p in params):
        scaled = _min_p(scaled, [p.min_p for p in params])
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(top_k):
        ranked = scaled.topk(max(top_k), dim=-1).values  # [R, max k], most likely first
        kth = ranked.gather(1, torch.tensor([max(k - 1, 0) for k in top_k], device=device).unsqueeze(1))
        kth[torch.tensor([k == 0 for k in top_k], device=device)] = float("-inf")
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    nucleus_rows = [row for row, p in enumerate(params) if p.top_p < 1.0]
    if nucleus_rows:
        index = torch.tensor(nucleus_rows, device=device)
        top_p = torch.tensor([params[row].top_p for row in nucleus_rows], dtype=probs.dtype, device=device)
        probs = probs.index_copy(0, index, _nucleus(probs.index_select(0, index), top_p))
    return probs


def _min_p(scaled: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """scaled [R, V] with -inf for each token whose probability is below min_p times its row's largest: in
    logits, below the row's maximum plus log(min_p) (a row with min_p 0 keeps everything)."""
    floors = torch.tensor([math.log(p) if p > 0.0 else float("-inf") for p in min_p], device=scaled.device)
    threshold = scaled.max(dim=-1, keepdim=True).values + floors.unsqueeze(1)
    return scaled.masked_fill(scaled < threshold, float("-inf"))


def _nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """probs [R, V] with every token outside each row's top-p nucleus zeroed: going from the most likely
    token down, a token is dropped once the mass before it reaches top_p (vLLM's rule). A row whose
    nucleus is not among the first candidates is done again over its whole vocabulary; either way a
    row's result depends on that row alone."""
    kept, complete = _nucleus_among(probs, top_p, min(probs.shape[-1], _NUCLEUS_CANDIDATES))
    if not bool(complete.all()):
        rows = (~complete).nonzero().squeeze(1)
        kept[rows] = _nucleus_among(probs[rows], top_p[rows], probs.shape[-1])[0]
    return kept


def _nucleus_among(probs: torch.Tensor, top_p: torch.Tensor, candidates: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The nucleus among each row's `candidates` most likely tokens, and whether that is all of it
    (their mass reaches top_p: every token after them is dropped anyway)."""
    ranked, order = probs.topk(candidates, dim=-1)  # most likely first
    mass = ranked.cumsum(dim=-1)
    kept = ranked.masked_fill(mass - ranked >= top_p.unsqueeze(1), 0.0)
    return torch.zeros_like(probs).scatter_(1, order, kept), mass[:, -1] >= top_p


def prompt_logprobs(logits: torch.Tensor, next_token_ids: torch.Tensor, num_top: int) -> list[TokenLogprobs]:
    """For each row i: the logprob of next_token_ids[i] (the prompt token that follows) and the num_top most
    likely tokens there. Raw model distribution: no temperature or filtering."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    actual = logprobs.gather(-1, next_token_ids.unsqueeze(-1)).squeeze(-1).tolist()
    tops = [()] * len(actual)
    if num_top:
        top_values, top_ids = logprobs.topk(num_top, dim=-1)
        tops = [tuple(zip(row_ids, row_values)) for row_ids, row_values in zip(top_ids.tolist(), top_values.tolist())]
    return [TokenLogprobs(token, value, top) for token, value, top in zip(next_token_ids.tolist(), actual, tops)]


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

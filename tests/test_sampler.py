"""Sampler behaviour: greedy, temperature, top-k, top-p, (seed, position) determinism, batch independence,
prompt logprobs."""
from __future__ import annotations

import random

import torch

from shared.engine.model import sampler
from shared.engine.model.sampler import RowHistory, filtered_probs, mix_seed, prompt_logprobs, sample
from shared.engine.model.spec_decode import NgramProposer
from shared.engine.request import SamplingParams


def _logits(rows: int = 4, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def sample_row(logits: torch.Tensor, params: SamplingParams, seed: int, position: int) -> int:
    """One row of [V] logits, alone in its batch."""
    return sample(logits.unsqueeze(0), [params], [seed], [position])[0]


def _probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row's filtered distribution, renormalised."""
    weights = filtered_probs(logits.unsqueeze(0), [params])[0]
    return weights / weights.sum()


def test_greedy_picks_argmax():
    logits = _logits()
    params = [SamplingParams()] * 4
    assert sample(logits, params, [0] * 4, [10] * 4) == logits.argmax(-1).tolist()


def test_mix_seed_is_stable_and_spreads():
    assert mix_seed(7, 3) == mix_seed(7, 3)
    values = {mix_seed(seed, pos) for seed in range(20) for pos in range(20)}
    assert len(values) == 400
    assert all(0 <= v < 2**63 for v in values)


def test_seeded_sampling_depends_only_on_seed_and_position():
    logits = _logits(rows=1, vocab=1000)[0] / 3
    params = SamplingParams(temperature=1.0, seed=123)
    first = [sample_row(logits, params, 123, pos) for pos in range(50)]
    again = [sample_row(logits.clone(), params, 123, pos) for pos in range(50)]
    assert first == again
    assert len(set(first)) > 10  # it is actually random across positions
    other_seed = [sample_row(logits, params, 124, pos) for pos in range(50)]
    assert other_seed != first


def test_seeded_row_is_batch_independent():
    logits = _logits(rows=6, vocab=300)
    params = [SamplingParams(temperature=0.8, seed=s) for s in range(6)]
    batch = sample(logits, params, list(range(6)), list(range(100, 106)))
    alone = [sample(logits[i:i + 1], [params[i]], [i], [100 + i])[0] for i in range(6)]
    assert batch == alone


def test_mixed_filters_are_batch_independent_and_match_the_row_alone(monkeypatch):
    """Rows with different temperature, top-k and top-p in one batch, greedy ones among them, and a
    nucleus wider than the candidates searched first (the whole-vocabulary path for that row only)."""
    monkeypatch.setattr(sampler, "_NUCLEUS_CANDIDATES", 8)
    logits = _logits(rows=8, vocab=2000, seed=3)
    logits[5] /= 20  # a flat row: its 0.95 nucleus holds far more than 8 tokens
    params = [SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=5),
              SamplingParams(temperature=0.9, top_p=0.5), SamplingParams(),
              SamplingParams(temperature=1.0, top_k=40, top_p=0.8), SamplingParams(temperature=1.0, top_p=0.95),
              SamplingParams(temperature=0.5, top_k=1), SamplingParams(temperature=2.0, top_p=0.3, min_p=0.1)]
    for position in range(20):
        seeds, positions = list(range(8)), [position] * 8
        batch = sample(logits, params, seeds, positions)
        alone = [sample(logits[i:i + 1], [params[i]], [i], [position])[0] for i in range(8)]
        assert batch == alone
        assert batch[3] == int(logits[3].argmax()) and batch[6] == int(logits[6].argmax())
        assert batch[1] in logits[1].topk(5).indices.tolist()


def test_top_k_restricts_support():
    logits = _logits(rows=1, vocab=100)[0]
    params = SamplingParams(temperature=1.0, top_k=3)
    allowed = set(logits.topk(3).indices.tolist())
    probs = _probs(logits, params)
    assert set(probs.nonzero().flatten().tolist()) == allowed
    assert all(sample_row(logits, params, 5, pos) in allowed for pos in range(200))


def test_min_p_drops_tokens_below_its_share_of_the_most_likely_after_temperature():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = _probs(logits, SamplingParams(temperature=1.0, min_p=0.4))  # floor: 0.2
    assert probs.nonzero().flatten().tolist() == [0, 1]
    torch.testing.assert_close(probs[:2] / probs.sum(), torch.tensor([0.625, 0.375]))
    # A higher temperature flattens the row first, so the same min_p keeps more (vLLM's order).
    assert _probs(logits, SamplingParams(temperature=3.0, min_p=0.5)).nonzero().flatten().tolist() == [0, 1, 2]
    assert _probs(logits, SamplingParams(temperature=1.0, min_p=0.0)).count_nonzero() == 4


def test_top_p_keeps_smallest_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = _probs(logits, SamplingParams(temperature=1.0, top_p=0.7))
    assert probs[2:].sum() == 0
    torch.testing.assert_close(probs[:2], torch.tensor([0.625, 0.375]))
    # Boundary: mass 0.8 exactly reached by the first two tokens keeps only those two.
    probs = _probs(logits, SamplingParams(temperature=1.0, top_p=0.8))
    assert probs.nonzero().flatten().tolist() == [0, 1]


def test_temperature_sharpens_and_flattens():
    logits = _logits(rows=1, vocab=20)[0]
    cold = _probs(logits, SamplingParams(temperature=0.1))
    hot = _probs(logits, SamplingParams(temperature=10.0))
    assert cold.max() > 0.9
    assert hot.max() < 0.3


def test_sampling_matches_distribution():
    logits = torch.log(torch.tensor([0.6, 0.3, 0.1]))
    params = SamplingParams(temperature=1.0, seed=1)
    draws = [sample_row(logits, params, 1, pos) for pos in range(3000)]
    freq = torch.bincount(torch.tensor(draws), minlength=3).float() / len(draws)
    torch.testing.assert_close(freq, torch.tensor([0.6, 0.3, 0.1]), atol=0.03, rtol=0)


def test_filtered_distributions_are_sampled_in_proportion():
    """top-k 3 of [0.4, 0.3, 0.2, 0.1] is [4/9, 3/9, 2/9]; top-p 0.6 keeps the first two as [4/7, 3/7]."""
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    for params, expected in ((SamplingParams(temperature=1.0, top_k=3), [4 / 9, 3 / 9, 2 / 9, 0.0]),
                             (SamplingParams(temperature=1.0, top_p=0.6), [4 / 7, 3 / 7, 0.0, 0.0])):
        draws = sample(logits.expand(4000, 4), [params] * 4000, [9] * 4000, list(range(4000)))
        freq = torch.bincount(torch.tensor(draws), minlength=4).float() / len(draws)
        torch.testing.assert_close(freq, torch.tensor(expected), atol=0.03, rtol=0)


def test_prompt_logprobs_report_actual_and_top_tokens():
    logits = _logits(rows=3, vocab=10)
    targets = torch.tensor([4, 0, 9])
    entries = prompt_logprobs(logits, targets, num_top=2)
    reference = torch.log_softmax(logits, -1)
    for row, entry in enumerate(entries):
        assert (entry.token_id, entry.logprob) == (targets[row].item(), reference[row, targets[row]].item())
        top = reference[row].topk(2)
        assert entry.top == tuple(zip(top.indices.tolist(), top.values.tolist()))  # most likely first
    assert all(entry.top == () for entry in prompt_logprobs(logits, targets, num_top=0))


def test_ngram_proposer_uses_latest_longest_match():
    proposer = NgramProposer(num_speculative_tokens=3, min_n=1, max_n=3)
    #            0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 4, 6, 7, 2, 3, 4]
    # Suffix (2, 3, 4) last occurred at index 6, followed by 6, 7, 2.
    assert proposer.propose(tokens) == [6, 7, 2]
    assert proposer.propose(tokens, max_drafts=1) == [6]
    assert proposer.propose([5, 6, 7]) == []
    assert proposer.propose(tokens, max_drafts=0) == []


def _dense_penalties(logits: torch.Tensor, params: list[SamplingParams], histories) -> torch.Tensor:
    """vLLM's formulas over the whole vocabulary (the reference for the sampler's per-seen-token version)."""
    out = logits.clone()
    for row, (p, history) in enumerate(zip(params, histories)):
        counts = torch.zeros(logits.shape[-1])
        counts.scatter_add_(0, torch.tensor(history.token_ids[history.output_start:], dtype=torch.long),
                            torch.ones(len(history.token_ids) - history.output_start))
        seen = torch.zeros(logits.shape[-1], dtype=torch.bool)
        seen[torch.tensor(history.token_ids, dtype=torch.long)] = True
        rep = torch.tensor(p.repetition_penalty)
        x = torch.where(seen, torch.where(out[row] > 0, out[row] / rep, out[row] * rep), out[row])
        x = x - torch.tensor(p.frequency_penalty) * counts
        out[row] = x - torch.tensor(p.presence_penalty) * (counts > 0)
    return out


def test_penalties_touch_only_seen_tokens_and_equal_the_dense_formulas_bit_for_bit():
    rng = random.Random(0)
    for _ in range(30):
        rows, vocab = rng.randint(1, 5), rng.choice([50, 4000])
        logits = _logits(rows, vocab, seed=rng.randrange(100))
        logits[0, 0] = float("-inf")  # a grammar-masked token stays masked
        params = [SamplingParams(repetition_penalty=rng.choice([1.0, 1.3, 0.8]),
                                 frequency_penalty=rng.choice([0.0, 0.5, -0.3]),
                                 presence_penalty=rng.choice([0.0, 1.2])) for _ in range(rows)]
        histories = []
        for _ in range(rows):
            tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 200))]
            histories.append(RowHistory(tokens, rng.randint(0, len(tokens)), 0, frozenset()))
        got = sampler._apply_penalties(logits.clone(), params, histories)
        assert torch.equal(got, _dense_penalties(logits, params, histories))

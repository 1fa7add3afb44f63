"""A step's outputs from its logits: sampled tokens (grammar-masked, penalised), drafts verified,
logprobs of sampled and prompt tokens, and the n-gram drafts proposed for the next step."""
from __future__ import annotations

import torch

from shared.engine.grammar import allocate_bitmask, allowed_from_bitmask
from shared.engine.model.sampler import RowHistory, output_logprobs, prompt_logprobs, sample
from shared.engine.model.spec_decode import NgramProposer
from shared.engine.model.step_inputs import ScheduledRequest
from shared.engine.request import SamplingParams, TokenLogprobs


def index_tensor(values, device: torch.device) -> torch.Tensor:
    """An index tensor on the given device."""
    return torch.tensor(values, dtype=torch.long, device=device)


def take_rows(tensor: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """tensor[rows]; the tensor itself when rows are all of its rows in order (a decode step)."""
    if len(rows) == tensor.shape[0] and rows == list(range(len(rows))):
        return tensor
    return tensor.index_select(0, index_tensor(rows, tensor.device))


class StepSampler:
    """Turns a step's logit rows into each request's accepted tokens and logprobs."""

    def __init__(self, device: torch.device, vocab_size: int, max_model_len: int,
                 proposer: NgramProposer | None):
        self.device = device
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.proposer = proposer

    def prompt_logprobs(self, scheduled: list[ScheduledRequest], logits: torch.Tensor,
                        prompt_slices: dict[str, tuple[int, int, int]]) -> dict[str, list]:
        """req_id -> the logprobs of the prompt tokens its slice of logit rows predicts."""
        lps = {}
        for r in scheduled:
            if r.req_id in prompt_slices:
                first, count, start = prompt_slices[r.req_id]
                targets = index_tensor(r.state.token_ids[start + 1:start + 1 + count], self.device)
                lps[r.req_id] = prompt_logprobs(logits[first:first + count], targets,
                                                r.state.sampling_params.prompt_logprobs)
        return lps

    def _history(self, r: ScheduledRequest, allowed: torch.Tensor | None) -> RowHistory | None:
        """Only requests whose logits are processed need one; they never carry drafts (see propose)."""
        state, params = r.state, r.state.sampling_params
        if not params.processes_logits:
            return None
        num_sampled = len(state.token_ids) - state.num_prompt_tokens
        return RowHistory(state.token_ids, state.output_start, num_sampled, state.stop_token_ids, allowed)

    def _grammar_masks(self, scheduled: list[ScheduledRequest], sample_slices) -> dict[str, torch.Tensor]:
        """req_id -> bool [V] of the tokens its grammar allows next, unpacked for all requests at once."""
        grammars = {
            r.req_id: r.state.structured_output_request.grammar for r in scheduled
            if r.req_id in sample_slices and r.state.structured_output_request is not None
        }
        if not grammars:
            return {}
        bitmask = allocate_bitmask(len(grammars), self.vocab_size)
        for row, grammar in enumerate(grammars.values()):
            grammar.fill_bitmask(bitmask, row)
        allowed = allowed_from_bitmask(bitmask, self.vocab_size).to(self.device)
        return dict(zip(grammars, allowed))

    def sample(self, scheduled: list[ScheduledRequest], logits: torch.Tensor,
               sample_slices: dict[str, tuple[int, int]]) -> tuple[dict[str, list[int]], dict[str, list]]:
        masks = self._grammar_masks(scheduled, sample_slices)
        sampling = [r for r in scheduled if r.req_id in sample_slices]
        rows, params, seeds, positions, histories = [], [], [], [], []
        for r in sampling:
            first, k = sample_slices[r.req_id]
            state = r.state
            # Row first + j predicts the token at position (first sampled position) + j.
            next_pos = r.start + len(r.input_ids) - k + 1
            history = self._history(r, masks.get(r.req_id))
            rows.extend(range(first, first + k))
            positions.extend(range(next_pos, next_pos + k))
            params += [state.sampling_params] * k
            seeds += [state.seed] * k
            histories += [history] * k
        row_logits = take_rows(logits, rows)
        tokens = sample(row_logits, params, seeds, positions, histories)
        row_lps = self._output_logprobs(row_logits, tokens, params)
        out: dict[str, list[int]] = {}
        out_lps: dict[str, list] = {}
        first_row = 0
        for r in sampling:
            accepted = self._accepted(r.drafts, tokens[first_row:first_row + len(r.drafts) + 1])
            r.state.token_ids.extend(accepted)
            out[r.req_id] = accepted
            if first_row in row_lps:
                out_lps[r.req_id] = [row_lps[first_row + j] for j in range(len(accepted))]
            first_row += len(r.drafts) + 1
        return out, out_lps

    def _output_logprobs(self, row_logits: torch.Tensor, tokens: list[int],
                         params: list[SamplingParams]) -> dict[int, TokenLogprobs]:
        """row -> the logprobs entry of its sampled token, for the rows whose request asks for them."""
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not lp_rows:
            return {}
        picked = row_logits.index_select(0, index_tensor(lp_rows, self.device))
        entries = output_logprobs(picked, [tokens[i] for i in lp_rows], [params[i].logprobs for i in lp_rows])
        return dict(zip(lp_rows, entries))

    @staticmethod
    def _accepted(drafts: list[int], candidates: list[int]) -> list[int]:
        """Verification: a draft stands while the model (greedy or seeded) picks that very token, so
        speculation never changes the output; the first disagreement is the bonus token."""
        if not drafts:
            return candidates
        accepted = []
        for j, token in enumerate(candidates):
            accepted.append(token)
            if j == len(drafts) or token != drafts[j]:
                break
        return accepted

    def propose(self, r: ScheduledRequest) -> list[int]:
        state = r.state
        if state.sampling_params.processes_logits:
            return []  # a draft's logits would need the history (and grammar state) of the drafts before it
        num_output = len(state.token_ids) - state.num_prompt_tokens
        # Drafts past max_tokens or the model length could never be kept.
        room = min(state.sampling_params.max_tokens - num_output, self.max_model_len - len(state.token_ids)) - 1
        return self.proposer.propose(state.token_ids, max_drafts=room)

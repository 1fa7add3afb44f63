"""The model runner: executes a SchedulerOutput on the paged KV cache and returns a ModelRunnerOutput.

It owns the KV pool, per-request token lists and block tables, the sampler and the n-gram proposer,
and calls the worker side of a KV connector around each forward pass. It never decides anything.
"""
from __future__ import annotations

import logging
import random
from dataclasses import dataclass

import numpy as np
import torch

from shared.engine.kv_transfer.connector import KVConnectorBase
from shared.engine.model.attention import (
    CPU_DECODE_KERNEL, TRITON, AttentionMetadata, OutputRows, SequenceSpan, select_attention_backend,
)
from shared.engine.model.block_tables import BlockTables
from shared.engine.model.cuda_graphs import DEFAULT_BATCH_SIZES, DecodeGraphs
from shared.engine.grammar import allocate_bitmask, allowed_from_bitmask
from shared.engine.model.loader import LoadedModel
from shared.engine.model.paged_decode import paged_decode_available
from shared.engine.model.sampler import RowHistory, output_logprobs, prompt_logprobs, sample
from shared.engine.model.spec_decode import NgramProposer
from shared.engine.request import SamplingParams, TokenLogprobs
from shared.engine.sched.output import KVConnectorOutput, ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


def _triton_importable() -> bool:
    """Triton is optional and imported only when asked here (on CUDA): a CPU pod never loads it."""
    from shared.engine.model.triton_attention import triton_available

    return triton_available()


@dataclass
class _RequestState:
    token_ids: list[int]  # prompt + every output token known to the runner
    num_prompt_tokens: int
    sampling_params: SamplingParams
    seed: int  # the request's seed, or one the runner drew for it (so its samples stay batch-independent)
    table_row: int  # its row in the runner's BlockTables
    num_computed_tokens: int
    output_start: int  # index in token_ids of the first output token (penalties count from it)
    stop_token_ids: frozenset[int]  # EOS (unless ignored) and the stop tokens: what min_tokens holds back
    structured_output_request: object | None = None


@dataclass
class _ScheduledRequest:
    req_id: str
    state: _RequestState
    start: int  # position of the first token computed this step
    input_ids: list[int]
    drafts: list[int]
    samples: bool  # the step reaches the end of the known tokens, so it samples


class ModelRunner:
    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int, *,
                 num_speculative_tokens: int = 0, ngram_min: int = 1, ngram_max: int = 3,
                 connector: KVConnectorBase | None = None, max_model_len: int | None = None, seed: int = 0,
                 device: torch.device | str = "cpu", eos_token_ids: tuple[int, ...] = (),
                 cuda_graphs: bool | None = None, cuda_graph_batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES):
        """device: where the KV pool and every input live; the model must already be there.
        eos_token_ids: held back (with each request's stop tokens) until the request's min_tokens.
        cuda_graphs: replay decode-only steps of up to max(cuda_graph_batch_sizes) requests as CUDA
        graphs; None: on for CUDA, off elsewhere (True on the CPU runs the same padded static-buffer
        forward eagerly, which is how the tests check it)."""
        self.eos_token_ids = frozenset(eos_token_ids)
        self.device = torch.device(device)
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.config = loaded.config
        # Build (or load the cached build of) the decode kernel now, while the pod is still starting,
        # not on the first decode step (a cold build takes about 10 s on 2 cores). Without it, decodes
        # take the gather + SDPA path, which needs a key mask.
        self.attention_backend = select_attention_backend(
            self.device.type, triton_available=self.device.type == "cuda" and _triton_importable(),
            cpu_kernel_available=paged_decode_available(self.config.torch_dtype, self.device))
        self._uses_decode_kernel = self.attention_backend == CPU_DECODE_KERNEL
        self._uses_triton = self.attention_backend == TRITON
        logger.info("attention path: %s (%s on %s)", self.attention_backend, self.config.torch_dtype,
                    self.device.type)
        self.model = loaded.model
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len or self.config.max_position_embeddings
        if self.max_model_len > self.config.max_position_embeddings:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's "
                f"{self.config.max_position_embeddings} positions"
            )
        self.proposer = NgramProposer(num_speculative_tokens, ngram_min, ngram_max) if num_speculative_tokens else None
        self.connector = connector
        self._seed_source = random.Random(seed)
        self.requests: dict[str, _RequestState] = {}
        self.block_tables = BlockTables()
        # req_id -> first prompt position whose logprobs are not reported yet (survives preemption).
        self._prompt_logprobs_next: dict[str, int] = {}
        self._allocate_kv_cache()
        if connector is not None:
            connector.register_kv_caches(self.kv_caches)
        self.decode_graphs = self._make_decode_graphs(cuda_graphs, cuda_graph_batch_sizes)

    def _make_decode_graphs(self, cuda_graphs: bool | None, batch_sizes: tuple[int, ...]) -> DecodeGraphs | None:
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda"
        if not cuda_graphs:
            return None
        if not (self._uses_triton or self._uses_decode_kernel):
            # The gather + SDPA decode sizes its key mask by each step's widest table: nothing static.
            logger.warning("CUDA graphs off: the %s decode path cannot be captured", self.attention_backend)
            return None
        max_blocks = -(-self.max_model_len // self.block_size)
        capture = self.device.type == "cuda"
        logger.info("decode graphs for batch sizes %s (%s)", batch_sizes, "captured" if capture else "eager")
        graphs = DecodeGraphs(self.model, self.layer_kv, max_blocks, self.device, use_triton=self._uses_triton,
                              capture=capture, batch_sizes=batch_sizes)
        if capture:
            graphs.capture_all()
        return graphs

    def _allocate_kv_cache(self) -> None:
        c = self.config
        # One buffer for the whole pool; each layer's K and V is a contiguous [num_blocks, ...] slice of it,
        # so block b of a layer is one contiguous span (what a transfer agent registers and reads).
        self.kv_cache_buffer = torch.zeros(
            c.num_layers, 2, self.num_blocks, self.block_size, c.num_kv_heads, c.head_dim, dtype=c.torch_dtype,
            device=self.device,
        )
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.layer_kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i in range(c.num_layers):
            key, value = self.kv_cache_buffer[i, 0], self.kv_cache_buffer[i, 1]
            self.kv_caches[f"layers.{i}.key"] = key
            self.kv_caches[f"layers.{i}.value"] = value
            self.layer_kv.append((key, value))

    def _ids(self, values) -> torch.Tensor:
        """An index tensor on the runner's device."""
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _rows(self, tensor: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """tensor[rows]; the tensor itself when rows are all of its rows in order (a decode step)."""
        if len(rows) == tensor.shape[0] and rows == list(range(len(rows))):
            return tensor
        return tensor.index_select(0, self._ids(rows))

    def _from_host(self, array: np.ndarray) -> torch.Tensor:
        """An int64 host array as a tensor on the runner's device (a copy: the array may change)."""
        return torch.from_numpy(array).to(self.device, copy=True)

    # ---- request state ----------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self._forget(req_id)
            self._prompt_logprobs_next.pop(req_id, None)
        for req_id in so.preempted_req_ids or ():
            self._forget(req_id)
        for new in so.scheduled_new_reqs:
            params = new.sampling_params
            seed = params.seed if params.seed is not None else self._seed_source.getrandbits(63)
            self._forget(new.req_id)  # a request resumed without its preemption reported
            self.requests[new.req_id] = _RequestState(
                token_ids=list(new.prefill_token_ids), num_prompt_tokens=len(new.prompt_token_ids),
                sampling_params=params, seed=seed, table_row=self.block_tables.add(list(new.block_ids)),
                num_computed_tokens=new.num_computed_tokens,
                output_start=len(new.prompt_token_ids) - new.num_prior_output_tokens,
                stop_token_ids=self._stop_token_ids(params),
                structured_output_request=new.structured_output_request,
            )
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests.get(req_id)
            if state is None:
                raise ValueError(f"scheduled cached request {req_id!r} is unknown to the runner")
            if cached.new_block_ids[i]:
                self.block_tables.extend(state.table_row, cached.new_block_ids[i])
            if cached.new_token_ids[i]:
                state.token_ids.extend(cached.new_token_ids[i])
            state.num_computed_tokens = cached.num_computed_tokens[i]

    def _forget(self, req_id: str) -> None:
        state = self.requests.pop(req_id, None)
        if state is not None:
            self.block_tables.free(state.table_row)

    def _stop_token_ids(self, params: SamplingParams) -> frozenset[int]:
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        return frozenset(stop_ids)

    def _schedule(self, so: SchedulerOutput) -> list[_ScheduledRequest]:
        scheduled = []
        for req_id, num_tokens in so.num_scheduled_tokens.items():
            if num_tokens <= 0:
                continue
            state = self.requests[req_id]
            drafts = list(so.scheduled_spec_decode_tokens.get(req_id, ()))
            start = state.num_computed_tokens
            num_known = num_tokens - len(drafts)
            known = state.token_ids[start:start + num_known]
            if len(known) != num_known:
                raise ValueError(
                    f"request {req_id!r}: {num_known} tokens scheduled from position {start} but the runner "
                    f"knows only {len(state.token_ids)} tokens"
                )
            end = start + num_known + len(drafts)
            num_blocks = self.block_tables.num_blocks(state.table_row)
            if end > num_blocks * self.block_size:
                raise ValueError(f"request {req_id!r}: {end} tokens do not fit its {num_blocks} blocks")
            samples = start + num_known >= len(state.token_ids)
            scheduled.append(_ScheduledRequest(req_id, state, start, known + drafts, drafts, samples))
        # Single-token steps first: they share one batched decode attention.
        scheduled.sort(key=lambda r: len(r.input_ids) > 1)
        return scheduled

    # ---- execution ---------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        if self.connector is not None and so.kv_connector_metadata is not None:
            self.connector.start_load_kv(so.kv_connector_metadata)
        scheduled = self._schedule(so)
        sampled: dict[str, list[int]] = {}
        prompt_lps: dict[str, list] = {}
        sampled_lps: dict[str, list] = {}
        if scheduled:
            sampled, prompt_lps, sampled_lps = self._run(scheduled)
        req_ids = [r.req_id for r in scheduled]
        output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
            sampled_token_ids=[sampled.get(req_id, []) for req_id in req_ids],
            prompt_logprobs_dict=prompt_lps,
            logprobs=sampled_lps,
        )
        if self.proposer is not None:
            output.spec_token_ids = [self._propose(r) if r.req_id in sampled else [] for r in scheduled]
        if self.connector is not None:
            output.kv_connector_output = self._connector_output(so)
        return output

    def _connector_output(self, so: SchedulerOutput) -> KVConnectorOutput:
        self.connector.wait_for_save()
        finished_sending, finished_recving = self.connector.get_finished(so.finished_req_ids)
        return KVConnectorOutput(
            finished_sending=finished_sending, finished_recving=finished_recving,
            invalid_block_ids=set(self.connector.get_block_ids_with_load_errors()),
        )

    def _run(self, scheduled: list[_ScheduledRequest]) -> tuple[dict[str, list[int]], dict[str, list], dict[str, list]]:
        input_ids, positions, rows, counts = [], [], [], []
        for r in scheduled:
            n = len(r.input_ids)
            input_ids.extend(r.input_ids)
            positions.extend(range(r.start, r.start + n))
            rows.append(r.state.table_row)
            counts.append(n)
        host_positions = np.array(positions, dtype=np.int64)
        token_rows = rows if len(rows) == len(positions) else np.repeat(rows, counts)
        slots = self.block_tables.slots(token_rows, host_positions, self.block_size)
        meta = self._attention_metadata(scheduled)
        ids_t = self._ids(input_ids)
        pos_t = self._from_host(host_positions)
        meta.slot_mapping = self._from_host(slots)
        logit_rows, sample_slices, prompt_slices = self._select_logit_rows(scheduled)
        output_rows, hidden_rows = self._output_rows(scheduled, meta, logit_rows)
        if self._graph_runs(meta, output_rows):
            hidden = self.decode_graphs.run(ids_t, pos_t, meta)
        else:
            hidden = self.model(ids_t, pos_t, self.layer_kv, meta, output_rows)
        if not logit_rows:
            return {}, {}, {}
        logits = self.model.compute_logits(self._rows(hidden, hidden_rows))
        sampled, sampled_lps = self._sample(scheduled, logits, sample_slices)
        lps = {}
        for r in scheduled:
            if r.req_id in prompt_slices:
                first, count, start = prompt_slices[r.req_id]
                targets = self._ids(r.state.token_ids[start + 1:start + 1 + count])
                lps[r.req_id] = prompt_logprobs(logits[first:first + count], targets,
                                                r.state.sampling_params.prompt_logprobs)
        return sampled, lps, sampled_lps

    def _graph_runs(self, meta: AttentionMetadata, output_rows: OutputRows | None) -> bool:
        """A decode-only step (every row kept) small enough for the largest graph."""
        return (self.decode_graphs is not None and not meta.spans and output_rows is None
                and self.decode_graphs.can_run(meta.num_decode_tokens))

    def _select_logit_rows(self, scheduled: list[_ScheduledRequest]):
        """Rows to turn into logits: the last (drafts + 1) rows of a sampling request, and the rows that
        predict a prompt token when prompt logprobs are asked for. Returns (rows, sample slices
        {req_id: (first logit row, count)}, prompt slices {req_id: (first logit row, count, position)})."""
        logit_rows: list[int] = []
        row = 0
        sample_slices: dict[str, tuple[int, int]] = {}
        prompt_slices: dict[str, tuple[int, int, int]] = {}
        for r in scheduled:
            n = len(r.input_ids)
            if r.state.sampling_params.prompt_logprobs is not None:
                # Positions p in this chunk with p + 1 still a prompt token, minus any reported
                # before a preemption (a resumed request recomputes its prompt).
                first_pos = max(r.start, self._prompt_logprobs_next.get(r.req_id, 0))
                end_pos = min(r.start + n, r.state.num_prompt_tokens - 1)
                if end_pos > first_pos:
                    prompt_slices[r.req_id] = (len(logit_rows), end_pos - first_pos, first_pos)
                    first_row = row + first_pos - r.start
                    logit_rows.extend(range(first_row, first_row + end_pos - first_pos))
                    self._prompt_logprobs_next[r.req_id] = end_pos
            if r.samples:
                k = len(r.drafts) + 1
                sample_slices[r.req_id] = (len(logit_rows), k)
                logit_rows.extend(range(row + n - k, row + n))
            row += n
        return logit_rows, sample_slices, prompt_slices

    def _output_rows(self, scheduled: list[_ScheduledRequest], meta: AttentionMetadata,
                     logit_rows: list[int]) -> tuple[OutputRows | None, list[int]]:
        """The rows the last layer must finish (decode rows, and each span from its first row that
        needs logits), and logit_rows renumbered into them. None when every row is needed anyway."""
        num_decodes = meta.num_decode_tokens
        needed_from: dict[int, int] = {}  # span index -> first row (batch numbering) needing logits
        span_starts = [span.query_start for span in meta.spans]
        span_index = 0
        for row in sorted(logit_rows):
            if row < num_decodes:
                continue
            while span_index + 1 < len(span_starts) and span_starts[span_index + 1] <= row:
                span_index += 1
            needed_from.setdefault(span_index, row)
        kept_rows = list(range(num_decodes))
        spans = []
        for i, span in enumerate(meta.spans):
            if i not in needed_from:
                continue
            skip = needed_from[i] - span.query_start
            spans.append(SequenceSpan(len(kept_rows), span.query_len - skip, span.context_len, span.block_ids))
            kept_rows.extend(range(needed_from[i], span.query_start + span.query_len))
        num_rows = num_decodes + sum(span.query_len for span in meta.spans)
        if len(kept_rows) == num_rows:
            return None, logit_rows
        position = {row: i for i, row in enumerate(kept_rows)}
        keep_meta = AttentionMetadata(
            slot_mapping=None, num_decode_tokens=num_decodes, decode_block_table=meta.decode_block_table,
            decode_context_lens=meta.decode_context_lens, decode_key_mask=meta.decode_key_mask, spans=spans,
            decode_window_key_mask=meta.decode_window_key_mask, use_triton=meta.use_triton,
        )
        rows = self._ids(kept_rows)
        return OutputRows(rows=rows, meta=keep_meta), [position[row] for row in logit_rows]

    def _attention_metadata(self, scheduled: list[_ScheduledRequest]) -> AttentionMetadata:
        bs = self.block_size
        decodes = [r for r in scheduled if len(r.input_ids) == 1]
        table, lens, mask, window_mask = None, None, None, None
        if decodes:
            context = [r.start + 1 for r in decodes]
            width = max(-(-c // bs) for c in context)
            table = self._from_host(self.block_tables.gather([r.state.table_row for r in decodes], width))
            lens = self._ids(context)
            if not (self._uses_decode_kernel or self._uses_triton):
                mask = self._decode_key_mask(lens, width * bs)
                if self.config.has_sliding_window:
                    window_mask = self._decode_key_mask(lens, width * bs, self.config.sliding_window)
        spans = []
        row = len(decodes)
        for r in scheduled[len(decodes):]:
            n = len(r.input_ids)
            context_len = r.start + n
            block_ids = self._from_host(self.block_tables.blocks(r.state.table_row, -(-context_len // bs)))
            spans.append(SequenceSpan(query_start=row, query_len=n, context_len=context_len, block_ids=block_ids))
            row += n
        return AttentionMetadata(slot_mapping=None, num_decode_tokens=len(decodes), decode_block_table=table,
                                 decode_context_lens=lens, decode_key_mask=mask, spans=spans,
                                 decode_window_key_mask=window_mask, use_triton=self._uses_triton)

    def _decode_key_mask(self, context_lens: torch.Tensor, num_keys: int,
                         sliding_window: int | None = None) -> torch.Tensor:
        """[num_decodes, 1, 1, num_keys]: 0 for each request's context keys (the last sliding_window of
        them when given), -inf elsewhere."""
        key_positions = torch.arange(num_keys, device=self.device).unsqueeze(0)
        invalid = key_positions >= context_lens.unsqueeze(1)
        if sliding_window is not None:
            invalid |= key_positions < (context_lens - sliding_window).unsqueeze(1)
        # An additive float mask: SDPA's CPU kernel runs markedly faster with it than with a bool one.
        mask = torch.zeros(invalid.shape, dtype=self.config.torch_dtype, device=self.device)
        mask.masked_fill_(invalid, float("-inf"))
        return mask.view(len(context_lens), 1, 1, -1)

    def _history(self, r: _ScheduledRequest, allowed: torch.Tensor | None) -> RowHistory | None:
        """Only requests whose logits are processed need one; they never carry drafts (see _propose)."""
        state, params = r.state, r.state.sampling_params
        if not params.processes_logits:
            return None
        num_sampled = len(state.token_ids) - state.num_prompt_tokens
        return RowHistory(state.token_ids, state.output_start, num_sampled, state.stop_token_ids, allowed)

    def _grammar_masks(self, scheduled: list[_ScheduledRequest], sample_slices) -> dict[str, torch.Tensor]:
        """req_id -> bool [V] of the tokens its grammar allows next, unpacked for all requests at once."""
        grammars = {
            r.req_id: r.state.structured_output_request.grammar for r in scheduled
            if r.req_id in sample_slices and r.state.structured_output_request is not None
        }
        if not grammars:
            return {}
        bitmask = allocate_bitmask(len(grammars), self.config.vocab_size)
        for row, grammar in enumerate(grammars.values()):
            grammar.fill_bitmask(bitmask, row)
        allowed = allowed_from_bitmask(bitmask, self.config.vocab_size).to(self.device)
        return dict(zip(grammars, allowed))

    def _sample(self, scheduled: list[_ScheduledRequest], logits: torch.Tensor,
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
        row_logits = self._rows(logits, rows)
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
        picked = row_logits.index_select(0, self._ids(lp_rows))
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

    def _propose(self, r: _ScheduledRequest) -> list[int]:
        state = r.state
        if state.sampling_params.processes_logits:
            return []  # a draft's logits would need the history (and grammar state) of the drafts before it
        num_output = len(state.token_ids) - state.num_prompt_tokens
        # Drafts past max_tokens or the model length could never be kept.
        room = min(state.sampling_params.max_tokens - num_output, self.max_model_len - len(state.token_ids)) - 1
        return self.proposer.propose(state.token_ids, max_drafts=room)

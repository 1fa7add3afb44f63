"""The model runner: executes a SchedulerOutput on the paged KV cache and returns a ModelRunnerOutput.

It owns the KV pool and lays out each step's batch (token rows, slots, attention metadata, the rows
that need logits); the per-request state is step_inputs', the sampling step_outputs'. It calls the
worker side of a KV connector around each forward pass. It never decides anything.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from shared.engine.kv_transfer.connector import KVConnectorBase
from shared.engine.model.attention import (
    CPU_DECODE_KERNEL, TRITON, AttentionMetadata, OutputRows, SequenceSpan, select_attention_backend,
)
from shared.engine.model.cuda_graphs import DEFAULT_BATCH_SIZES, DecodeGraphs
from shared.engine.model.loader import LoadedModel
from shared.engine.model.paged_decode import paged_decode_available
from shared.engine.model.spec_decode import NgramProposer
from shared.engine.model.step_inputs import RequestStates, ScheduledRequest
from shared.engine.model.step_outputs import StepSampler, index_tensor, take_rows
from shared.engine.sched.output import KVConnectorOutput, ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


def _triton_importable() -> bool:
    """Triton is optional and imported only when asked here (on CUDA): a CPU pod never loads it."""
    from shared.engine.model.triton_attention import triton_available

    return triton_available()


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
        proposer = NgramProposer(num_speculative_tokens, ngram_min, ngram_max) if num_speculative_tokens else None
        self.connector = connector
        self.states = RequestStates(seed, frozenset(eos_token_ids))
        self.requests = self.states.requests  # the same dict, kept up to date by self.states
        self.block_tables = self.states.block_tables
        self.sampler = StepSampler(self.device, self.config.vocab_size, self.max_model_len, proposer)
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
        return index_tensor(values, self.device)

    def _from_host(self, array: np.ndarray) -> torch.Tensor:
        """An int64 host array as a tensor on the runner's device (a copy: the array may change)."""
        return torch.from_numpy(array).to(self.device, copy=True)

    # ---- execution ---------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.states.update(so)
        if self.connector is not None and so.kv_connector_metadata is not None:
            self.connector.start_load_kv(so.kv_connector_metadata)
        scheduled = self.states.schedule(so, self.block_size)
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
        if self.sampler.proposer is not None:
            output.spec_token_ids = [self.sampler.propose(r) if r.req_id in sampled else [] for r in scheduled]
        if self.connector is not None:
            output.kv_connector_output = self._connector_output(so)
        return output

    def _connector_output(self, so: SchedulerOutput) -> KVConnectorOutput:
        self.connector.wait_for_save()
        finished_sending, finished_recving = self.connector.get_finished(so.finished_req_ids)
        return KVConnectorOutput(
            finished_sending=finished_sending, finished_recving=finished_recving,
            invalid_block_ids=set(self.connector.get_block_ids_with_load_errors()),
            pull_stats=self.connector.get_pull_stats(),
        )

    def _run(self, scheduled: list[ScheduledRequest]) -> tuple[dict[str, list[int]], dict[str, list], dict[str, list]]:
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
        logits = self.model.compute_logits(take_rows(hidden, hidden_rows))
        sampled, sampled_lps = self.sampler.sample(scheduled, logits, sample_slices)
        return sampled, self.sampler.prompt_logprobs(scheduled, logits, prompt_slices), sampled_lps

    def _graph_runs(self, meta: AttentionMetadata, output_rows: OutputRows | None) -> bool:
        """A decode-only step (every row kept) small enough for the largest graph."""
        return (self.decode_graphs is not None and not meta.spans and output_rows is None
                and self.decode_graphs.can_run(meta.num_decode_tokens))

    def _select_logit_rows(self, scheduled: list[ScheduledRequest]):
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
                first_pos = max(r.start, self.states.prompt_logprobs_next.get(r.req_id, 0))
                end_pos = min(r.start + n, r.state.num_prompt_tokens - 1)
                if end_pos > first_pos:
                    prompt_slices[r.req_id] = (len(logit_rows), end_pos - first_pos, first_pos)
                    first_row = row + first_pos - r.start
                    logit_rows.extend(range(first_row, first_row + end_pos - first_pos))
                    self.states.prompt_logprobs_next[r.req_id] = end_pos
            if r.samples:
                k = len(r.drafts) + 1
                sample_slices[r.req_id] = (len(logit_rows), k)
                logit_rows.extend(range(row + n - k, row + n))
            row += n
        return logit_rows, sample_slices, prompt_slices

    def _output_rows(self, scheduled: list[ScheduledRequest], meta: AttentionMetadata,
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

    def _attention_metadata(self, scheduled: list[ScheduledRequest]) -> AttentionMetadata:
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

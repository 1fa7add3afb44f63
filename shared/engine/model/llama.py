"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) in torch, running on the paged KV cache.

q/k/v and gate/up projections are fused so a step does one matmul per projection for the whole
mixed batch; the loader splits and joins Hugging Face weights to match.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from shared.engine.model.attention import AttentionMetadata, OutputRows, paged_attention, write_kv
from shared.engine.model.model_config import ModelArchConfig
from shared.engine.model.linear import Linear, linear, pack_weight
from shared.engine.model.fused_ops import add_rms_norm, apply_rope, rms_norm_reference, rotate, silu_mul  # noqa: F401


# Rows of the MLP's chunks on the CPU, for steps of more than two chunks. With SmolLM2's 3,072-wide
# gate/up in bfloat16 on a 32 MB L3 (Zen 4, 2 threads), an 8,192-row step's MLP took 128 ms whole and
# 113 ms in chunks of 1,024 or 2,048 rows (float32: 290 vs 245 ms); at 4,096 rows and below whole was as
# fast or faster.
MLP_ROW_CHUNK = 2048


def rope_inverse_frequencies(config: ModelArchConfig) -> torch.Tensor:
    """Per-pair rotary frequencies, with llama3 or linear scaling applied the way transformers does."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    rope_type = scaling.get("rope_type", scaling.get("type"))
    factor = float(scaling["factor"])
    if rope_type == "linear":
        return inv_freq / factor
    # llama3: long wavelengths are slowed by factor, short ones kept, the band between interpolated.
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to max_position_embeddings, looked up per token."""

    def __init__(self, config: ModelArchConfig, device: torch.device | str = "cpu"):
        super().__init__()
        inv_freq = rope_inverse_frequencies(config).to(device)
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32, device=device)
        freqs = positions.unsqueeze(1) * inv_freq.unsqueeze(0)
        emb = torch.cat((freqs, freqs), dim=-1)
        dtype = config.torch_dtype
        self.register_buffer("cos", emb.cos().to(dtype), persistent=False)
        self.register_buffer("sin", emb.sin().to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # [T, 1, D]: broadcast over heads. index_select: advanced indexing (table[positions]) took
        # 0.5 ms for 128 rows of a small table on the CPU, a large share of a short prefill.
        return self.cos.index_select(0, positions).unsqueeze(1), self.sin.index_select(0, positions).unsqueeze(1)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device | str = "cpu"):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 whatever the storage dtype, as the reference implementation does.
        return rms_norm_reference(x, self.weight, self.eps)

    def add(self, residual: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + delta, its norm) in one pass where the fused op applies (residual updated in place)."""
        return add_rms_norm(residual, delta, self.weight, self.eps)


def _linear(in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
            device: torch.device | str) -> Linear:
    # Built on "meta" then allocated uninitialised: the loader overwrites every weight anyway.
    layer = Linear(in_features, out_features, bias=bias, dtype=dtype, device="meta")
    if torch.device(device).type != "meta":
        layer = layer.to_empty(device=device)
    return layer.requires_grad_(False)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelArchConfig, layer: int, device: torch.device | str = "cpu"):
        super().__init__()
        dtype = config.torch_dtype
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim ** -0.5
        self.sliding_window = config.layer_sliding_window(layer)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.qkv_proj = _linear(config.hidden_size, self.q_size + 2 * self.kv_size, config.attention_bias, dtype,
                                device)
        self.o_proj = _linear(self.q_size, config.hidden_size, config.o_proj_bias, dtype, device)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype, device)
        else:
            self.q_norm = self.k_norm = None
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.gate_up_proj = _linear(config.hidden_size, 2 * config.intermediate_size, config.mlp_bias, dtype,
                                    device)
        self.down_proj = _linear(config.intermediate_size, config.hidden_size, config.mlp_bias, dtype, device)
        self.intermediate_size = config.intermediate_size

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                keep: OutputRows | None = None,
                pending: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (hidden, the MLP's output still to be added to it): the next norm adds it in the same
        pass. pending: the previous layer's such output. keep: compute the layer's output only for these
        rows (K and V still for every row)."""
        num_tokens = hidden.shape[0]
        hidden, normed = self.input_layernorm.add(hidden, pending)
        qkv = self.qkv_proj(normed)
        # Rotate q and k heads together: one set of elementwise ops instead of two.
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads:])), dim=1)
        qk = rotate(qk, cos, sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, self.q_size + self.kv_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        key_cache, value_cache = kv_cache
        write_kv(key_cache, value_cache, k, v, meta.slot_mapping)
        if keep is not None:
            q, k, v, hidden = (t.index_select(0, keep.rows) for t in (q, k, v, hidden))
            meta = keep.meta
            num_tokens = hidden.shape[0]
        attn = paged_attention(q, k, v, key_cache, value_cache, meta, self.scale, self.sliding_window)
        hidden, normed = self.post_attention_layernorm.add(hidden, self.o_proj(attn.view(num_tokens, self.q_size)))
        return hidden, self.mlp(normed)

    def mlp(self, normed: torch.Tensor) -> torch.Tensor:
        """down(silu(gate) * up). A CPU step of more than two MLP_ROW_CHUNKs runs it a chunk of rows at a
        time: each row's output depends on its row alone (the same bits either way), and a chunk's
        gate/up output stays in cache for SiLU*up and down instead of going out to memory and back."""
        if normed.device.type != "cpu" or normed.shape[0] <= 2 * MLP_ROW_CHUNK:
            return self._mlp_rows(normed)
        return torch.cat([self._mlp_rows(rows) for rows in normed.split(MLP_ROW_CHUNK)])

    def _mlp_rows(self, normed: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_up_proj(normed), self.intermediate_size))


class LlamaModel(nn.Module):
    """Embeddings, decoder layers, final norm and LM head; forward returns hidden states."""

    def __init__(self, config: ModelArchConfig, device: torch.device | str = "cpu"):
        """device: where the (uninitialised) weights are allocated; "meta" allocates nothing (shapes only)."""
        super().__init__()
        self.config = config
        dtype = config.torch_dtype
        # Given its (meta) weight, nn.Embedding skips its random init (see Linear.reset_parameters).
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=torch.empty(
            config.vocab_size, config.hidden_size, dtype=dtype, device="meta"))
        if torch.device(device).type != "meta":
            self.embed_tokens = self.embed_tokens.to_empty(device=device)
        self.embed_tokens.requires_grad_(False)
        self.rotary = RotaryEmbedding(config, device)
        self.layers = nn.ModuleList(DecoderLayer(config, i, device) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.lm_head_packed: torch.Tensor | None = None  # set by pack_weights()
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = _linear(config.hidden_size, config.vocab_size, False, dtype, device)

    def pack_weights(self) -> None:
        """Reorder every linear weight (and the LM head) once for the CPU matmul library; call after
        loading and moving the model. A no-op where the packed path does not apply (CUDA, no oneDNN)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()
        self.lm_head_packed = pack_weight(self.lm_head_weight)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                output_rows: OutputRows | None = None) -> torch.Tensor:
        """Hidden states of every row, or only of output_rows.rows when given: past the last layer's
        K/V nothing else depends on the other rows, so its attention and MLP skip them."""
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions)
        last = len(self.layers) - 1
        pending = None
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            hidden, pending = layer(hidden, cos, sin, kv_cache, meta, output_rows if i == last else None, pending)
        return self.norm.add(hidden, pending)[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits for the given rows (only the rows that sample or need prompt logprobs)."""
        return linear(hidden, self.lm_head_weight, None, self.lm_head_packed).float()

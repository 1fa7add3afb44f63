"""Typed KV handoff instructions a request carries into the engine (Request.kv_transfer_params).

A connector acts only on the kinds it understands; a request without any runs locally.
"""
from __future__ import annotations

from dataclasses import dataclass

from shared.engine.kv_transfer.handle import KvHandle, KvSource
from shared.engine.request import Request, RequestStatus


class KvTransferParams:
    """Base of every handoff instruction (a connector checks which kind it was given)."""


@dataclass(frozen=True)
class HoldForPeer(KvTransferParams):
    """Producer: once token 1 is sampled, keep the prompt's blocks for a decode pod to pull (if hands_off)."""

    # The whole request's max_tokens, when the engine request here is capped at token 1 (None: more follow).
    max_tokens: int | None = None


def hands_off(request: Request, max_model_len: int) -> bool:
    """The one hand-off decision, made as a request finishes: its KV goes to a peer that continues it only when
    it asked to (HoldForPeer), token 1 ended it by its capped length (not EOS, a stop token or an abort), the
    whole request wants more tokens, and the model's length leaves room for them. Otherwise no hold: its blocks
    free at once, and token 1 is the request's last."""
    params = request.kv_transfer_params
    return (
        isinstance(params, HoldForPeer)
        and request.status == RequestStatus.FINISHED_LENGTH_CAPPED
        and (params.max_tokens is None or request.num_output_tokens < params.max_tokens)
        and request.num_tokens < max_model_len
    )


@dataclass(frozen=True)
class PullFromPeer(KvTransferParams):
    """Consumer: load the prompt's KV from the blocks a prefill pod holds under this handle.
    prompt_digest is computed by the decode pod from the request's own prompt: the confirmation
    sends it, so the hold is reported intact only for the prompt it was made for."""

    handle: KvHandle
    source: KvSource
    prompt_digest: bytes

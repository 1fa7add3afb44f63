"""Typed KV handoff instructions a request carries into the engine (Request.kv_transfer_params).

A connector acts only on the kinds it understands; a request without any runs locally.
"""
from __future__ import annotations

from dataclasses import dataclass

from shared.engine.kv_transfer.handle import KvHandle, KvSource


class KvTransferParams:
    """Base of every handoff instruction (a connector checks which kind it was given)."""


@dataclass(frozen=True)
class HoldForPeer(KvTransferParams):
    """Producer: once token 1 is sampled, keep the prompt's blocks for a decode pod to pull."""


@dataclass(frozen=True)
class PullFromPeer(KvTransferParams):
    """Consumer: load the prompt's KV from the blocks a prefill pod holds under this handle.
    prompt_digest is computed by the decode pod from the request's own prompt: the confirmation
    sends it, so the hold is reported intact only for the prompt it was made for."""

    handle: KvHandle
    source: KvSource
    prompt_digest: bytes

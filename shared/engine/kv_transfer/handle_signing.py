"""Signing KV handles with the key the pods of one deployment share (HMAC-SHA256 over a canonical
encoding of every handle field), so that nothing but a prefill pod of that deployment can mint one.
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import struct

from shared.engine.kv_transfer.handle import KvHandle

# Shorter keys are guessable; 32 random bytes is what the launcher generates.
MIN_KEY_BYTES = 16
_DOMAIN = b"pdserve-kv-handle-v1\x00"


def _field(data: bytes) -> bytes:
    return struct.pack("<I", len(data)) + data


def canonical_bytes(handle: KvHandle) -> bytes:
    """Every field but the signature, length-prefixed in a fixed order: two handles encode equal only
    when every signed field is equal."""
    layout = handle.layout
    parts = [
        _field(handle.engine_id.encode()),
        _field(handle.source_address.encode()),
        _field(struct.pack(f"<{len(handle.block_ids)}Q", *handle.block_ids)),
        struct.pack("<QQQ", handle.num_tokens, handle.block_size, handle.lease_deadline_unix_ms),
        _field(layout.model_name.encode()),
        _field(layout.dtype.encode()),
        struct.pack("<QQQQ", layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.block_size),
        _field(handle.prompt_digest),
    ]
    return _DOMAIN + b"".join(parts)


class HandleSigner:
    """Signs the handles a prefill pod mints and checks the ones a decode pod receives. Without a key
    (pods started with --insecure-unsigned-handles) it signs nothing and accepts every handle."""

    def __init__(self, key: bytes | None):
        if key is not None and len(key) < MIN_KEY_BYTES:
            raise ValueError(f"the KV handle key has {len(key)} bytes; at least {MIN_KEY_BYTES} are needed")
        self._key = key

    @property
    def is_signing(self) -> bool:
        return self._key is not None

    def _mac(self, handle: KvHandle) -> bytes:
        return hmac.new(self._key, canonical_bytes(handle), hashlib.sha256).digest()

    def sign(self, handle: KvHandle) -> KvHandle:
        if self._key is None:
            return handle
        return dataclasses.replace(handle, signature=self._mac(handle))

    def is_authentic(self, handle: KvHandle) -> bool:
        """True when the handle was signed with this deployment's key and not changed since."""
        if self._key is None:
            return True
        return hmac.compare_digest(handle.signature, self._mac(handle))

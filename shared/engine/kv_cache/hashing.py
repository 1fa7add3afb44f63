"""Chained prefix-cache block hashes, identical in every process and on every pod.

A block's hash covers its parent's hash, its token ids and its extra keys (multimodal inputs,
cache salt), so equal hashes mean equal prefixes. SHA-256 over a fixed little-endian encoding:
never Python's hash(), which is salted per process.
"""
from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

BlockHash = bytes

_LITTLE_ENDIAN = sys.byteorder == "little"


def root_hash(seed: str = "") -> BlockHash:
    """The parent hash of a request's first block; engines share prefixes only with equal seeds."""
    return hashlib.sha256(b"pdserve-prefix-v1\x00" + seed.encode()).digest()


def _encode_tokens(token_ids: Sequence[int]) -> bytes:
    packed = array("q", token_ids)
    if not _LITTLE_ENDIAN:
        packed.byteswap()
    return packed.tobytes()


def _encode_extra_keys(extra_keys: Sequence[object]) -> bytes:
    # Length-prefixed UTF-8 of each key's str(): unambiguous, stable across processes.
    parts = []
    for key in extra_keys:
        data = str(key).encode()
        parts.append(len(data).to_bytes(4, "little"))
        parts.append(data)
    return b"".join(parts)


def hash_block(
    parent_hash: BlockHash, token_ids: Sequence[int], extra_keys: Sequence[object] | None = None
) -> BlockHash:
    """Hash of one full block chained on its parent's hash."""
    h = hashlib.sha256(parent_hash)
    h.update(len(token_ids).to_bytes(4, "little"))
    h.update(_encode_tokens(token_ids))
    if extra_keys:
        h.update(b"\x01")
        h.update(_encode_extra_keys(extra_keys))
    return h.digest()


def hash_block_tokens(
    parent_hash: BlockHash, token_ids: Sequence[int], block_size: int
) -> list[BlockHash]:
    """Hashes of every full block of token_ids (no extra keys), chained from parent_hash."""
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent_hash = hash_block(parent_hash, token_ids[start:start + block_size])
        hashes.append(parent_hash)
    return hashes


def prompt_digest(token_ids: Sequence[int], block_size: int) -> bytes:
    """One digest of a whole prompt: its blocks' chained hashes, the last partial block included, from
    the unsalted root. Equal digests mean equal prompt tokens, so a KV hold is bound to its prompt."""
    if not token_ids:
        raise ValueError("a prompt digest needs at least one token")
    parent = root_hash()
    for start in range(0, len(token_ids), block_size):
        parent = hash_block(parent, token_ids[start:start + block_size])
    return parent

"""The mapping of kv_events.proto: the prefix-cache event updates a pod streams."""
from __future__ import annotations

from proto.pdserve.v1 import kv_events_pb2
from shared.engine.kv_cache.events import KvEvent, KvEventKind
from shared.serving.wire.payloads import KvEventUpdate


_KV_EVENT_TO_PROTO = {
    KvEventKind.STORED: kv_events_pb2.KV_EVENT_KIND_STORED,
    KvEventKind.REMOVED: kv_events_pb2.KV_EVENT_KIND_REMOVED,
    KvEventKind.CLEARED: kv_events_pb2.KV_EVENT_KIND_CLEARED,
}
_KV_EVENT_FROM_PROTO = {v: k for k, v in _KV_EVENT_TO_PROTO.items()}
BLOCK_HASH_BYTES = 32


def kv_event_update_to_proto(update: KvEventUpdate) -> kv_events_pb2.SubscribeKvEventsResponse:
    return kv_events_pb2.SubscribeKvEventsResponse(
        engine_id=update.engine_id,
        block_size=update.block_size,
        root_hash=update.root_hash,
        is_snapshot=update.is_snapshot,
        events=[kv_events_pb2.KvEvent(kind=_KV_EVENT_TO_PROTO[e.kind], block_hash=e.block_hash) for e in update.events],
    )


def kv_event_update_from_proto(message: kv_events_pb2.SubscribeKvEventsResponse) -> KvEventUpdate:
    if not message.engine_id:
        raise ValueError("kv event update: engine_id is empty")
    if message.block_size < 1:
        raise ValueError("kv event update: block_size must be >= 1")
    if len(message.root_hash) != BLOCK_HASH_BYTES:
        raise ValueError(f"kv event update: root_hash must be {BLOCK_HASH_BYTES} bytes, got {len(message.root_hash)}")
    events = []
    for event in message.events:
        kind = _KV_EVENT_FROM_PROTO.get(event.kind)
        if kind is None:
            raise ValueError(f"kv event update: unknown event kind {event.kind}")
        expected = 0 if kind is KvEventKind.CLEARED else BLOCK_HASH_BYTES
        if len(event.block_hash) != expected:
            raise ValueError(f"kv event update: a {kind.value} event needs a {expected}-byte hash, "
                             f"got {len(event.block_hash)} bytes")
        events.append(KvEvent(kind, event.block_hash))
    return KvEventUpdate(message.engine_id, message.block_size, message.root_hash, message.is_snapshot, events)

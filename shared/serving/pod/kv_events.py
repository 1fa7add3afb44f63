"""A pod's prefix-cache event feed: attaches an event log to the engine's block pool while anyone
subscribes, and serves each subscriber a snapshot followed by every stored and removed block hash
(KvEventService/SubscribeKvEvents)."""
from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator

from proto.pdserve.v1 import kv_events_pb2_grpc
from shared.engine.kv_cache.events import DEFAULT_MAX_PENDING_EVENTS, KvEvent, KvEventKind, KvEventLog
from shared.serving.wire.kv_events import kv_event_update_to_proto
from shared.serving.pod.servicer import PodServicer
from shared.serving.wire.payloads import KvEventUpdate

logger = logging.getLogger(__name__)

# How often pending events go out: routers see a stored block at most this late.
FLUSH_INTERVAL_S = 0.01
# Hashes per message: a large pool's snapshot goes out in several messages, each well under the
# gRPC message limit (4096 x ~36 bytes).
MAX_EVENTS_PER_MESSAGE = 4096
# Per-subscriber cap on events queued for sending; a subscriber that falls this far behind gets a
# fresh snapshot instead of the backlog.
MAX_QUEUED_EVENTS = DEFAULT_MAX_PENDING_EVENTS


class _Resync:
    """Queued instead of a backlog: the subscriber must start over from a snapshot."""


_RESYNC = _Resync()
# Queued at shutdown: the subscription ends (an open stream would hold the server's stop for its grace).
_END = object()


class _Subscriber:
    def __init__(self) -> None:
        self.queue: asyncio.Queue[list[KvEvent] | _Resync] = asyncio.Queue()
        self.num_queued_events = 0

    def put(self, events: list[KvEvent]) -> None:
        if self.num_queued_events + len(events) > MAX_QUEUED_EVENTS:
            self.resync()
            return
        self.num_queued_events += len(events)
        self.queue.put_nowait(events)

    def resync(self) -> None:
        """Drop the backlog: the subscriber starts over from a snapshot."""
        while not self.queue.empty():
            self.queue.get_nowait()
        self.num_queued_events = 0
        self.queue.put_nowait(_RESYNC)


class KvEventFeed:
    """Publishes one pod's prefix-cache changes. Create and use on the pod's event loop."""

    def __init__(self, pod, max_pending_events: int = DEFAULT_MAX_PENDING_EVENTS):
        self._pod = pod
        manager = pod.engine.scheduler.kv_cache_manager
        self._pool = manager.block_pool
        self._block_size = manager.block_size
        self._root_hash = manager.root_hash
        self._log = KvEventLog(max_pending_events)
        self._subscribers: set[_Subscriber] = set()
        # While a snapshot is being taken, events recorded after it must wait in the log until the
        # new subscriber is listed, so the flusher leaves the log alone.
        self._num_snapshots_in_flight = 0
        self._flusher: asyncio.Task | None = None

    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers)

    async def subscribe(self) -> AsyncIterator[KvEventUpdate]:
        """A snapshot (one or more messages, the first marked), then the changes as they happen."""
        subscriber = _Subscriber()
        try:
            hashes = await self._attach_with_snapshot(subscriber)
            for update in self._snapshot_updates(hashes):
                yield update
            while True:
                item = await subscriber.queue.get()
                if item is _END:
                    return
                if isinstance(item, _Resync):
                    self._subscribers.discard(subscriber)
                    hashes = await self._attach_with_snapshot(subscriber)
                    for update in self._snapshot_updates(hashes):
                        yield update
                    continue
                subscriber.num_queued_events -= len(item)
                for start in range(0, len(item), MAX_EVENTS_PER_MESSAGE):
                    yield self._update(item[start:start + MAX_EVENTS_PER_MESSAGE])
        finally:
            self._unsubscribe(subscriber)

    async def _attach_with_snapshot(self, subscriber: _Subscriber) -> list[bytes]:
        """On the engine thread: hook the log into the pool, take what it recorded so far (it goes to
        the current subscribers) and every cached hash; then list the subscriber."""
        pool, log = self._pool, self._log

        def attach(_engine):
            pool.event_log = log
            return log.take(), pool.cached_hashes()

        self._num_snapshots_in_flight += 1
        try:
            earlier, hashes = await self._pod.loop.call(attach)
        finally:
            self._num_snapshots_in_flight -= 1
        if earlier.overflowed:
            self._resync_all()
        elif earlier.events:
            self._publish(earlier.events)
        self._subscribers.add(subscriber)
        if self._flusher is None:
            self._flusher = asyncio.ensure_future(self._flush_forever())
        return hashes

    def close(self) -> None:
        """End every subscription (the pod shuts down)."""
        for subscriber in self._subscribers:
            subscriber.queue.put_nowait(_END)

    def _unsubscribe(self, subscriber: _Subscriber) -> None:
        self._subscribers.discard(subscriber)
        if self._subscribers or self._num_snapshots_in_flight:
            return
        if self._flusher is not None:
            self._flusher.cancel()
            self._flusher = None
        pool = self._pool

        def detach(_engine):
            # Nobody listens: the pool's hook costs one None check again.
            pool.event_log = None

        if self._pod.loop.error is None:
            self._pod.loop.call(detach)
        self._log.take()

    async def _flush_forever(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_INTERVAL_S)
            if self._num_snapshots_in_flight:
                continue
            batch = self._log.take()
            if batch.overflowed:
                self._resync_all()
            elif batch.events:
                self._publish(batch.events)

    def _publish(self, events: list[KvEvent]) -> None:
        for subscriber in self._subscribers:
            subscriber.put(events)

    def _resync_all(self) -> None:
        logger.warning("kv events: more than %d pending, sending snapshots instead", self._log.max_pending)
        for subscriber in self._subscribers:
            subscriber.resync()

    def _update(self, events: list[KvEvent], is_snapshot: bool = False) -> KvEventUpdate:
        return KvEventUpdate(self._pod.engine_id, self._block_size, self._root_hash, is_snapshot, events)

    def _snapshot_updates(self, hashes: list[bytes]) -> list[KvEventUpdate]:
        stored = [KvEvent(KvEventKind.STORED, h) for h in hashes]
        chunks = [stored[i:i + MAX_EVENTS_PER_MESSAGE] for i in range(0, len(stored), MAX_EVENTS_PER_MESSAGE)]
        return [self._update(chunk, is_snapshot=index == 0) for index, chunk in enumerate(chunks or [[]])]


class KvEventServicer(PodServicer, kv_events_pb2_grpc.KvEventServiceServicer):
    """KvEventService on a prefill or decode pod."""

    def __init__(self) -> None:
        super().__init__()
        self.feed: KvEventFeed | None = None

    def attach(self, pod) -> None:
        super().attach(pod)
        self.feed = KvEventFeed(pod)

    async def close(self) -> None:
        if self.feed is not None:
            self.feed.close()

    async def SubscribeKvEvents(self, request, context):
        await self.require_pod(context)
        async for update in self.feed.subscribe():
            yield kv_event_update_to_proto(update)


KV_EVENT_SERVICE = "pdserve.v1.KvEventService"


def kv_event_service() -> tuple:
    """The (add-to-server, servicer, service name) entry run_pod takes, for a pod's service list."""
    return kv_events_pb2_grpc.add_KvEventServiceServicer_to_server, KvEventServicer(), KV_EVENT_SERVICE

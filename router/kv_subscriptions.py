"""Keeps one KV event stream open to every known pod and applies what arrives to the router's index;
a stream that ends (pod gone, restarted, unreachable) drops that pod's entries until it is back."""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Iterable, Sequence

import grpc

from proto.pdserve.v1 import kv_events_pb2, kv_events_pb2_grpc
from router.kv_index import KvIndex
from shared.serving.wire.kv_events import kv_event_update_from_proto
from shared.serving.server.tls import TlsConfig

logger = logging.getLogger(__name__)

# Wait between attempts to (re)open a pod's stream.
RETRY_INTERVAL_S = 1.0


class KvEventSubscriptions:
    def __init__(self, index: KvIndex, channel_options: Sequence[tuple[str, Any]] = (),
                 retry_interval_s: float = RETRY_INTERVAL_S, tls: TlsConfig = TlsConfig()):
        self._index = index
        self._tls = tls  # how the streams to the pods connect
        self._channel_options = list(channel_options)
        self._retry_interval_s = retry_interval_s
        self._tasks: dict[str, asyncio.Task] = {}

    def sync(self, addresses: Iterable[str]) -> None:
        """Follow exactly these pods: open streams to new ones, close those no longer listed."""
        wanted = set(addresses)
        for address in wanted - self._tasks.keys():
            self._tasks[address] = asyncio.ensure_future(self._follow(address))
        for address in self._tasks.keys() - wanted:
            self._tasks.pop(address).cancel()
            self._index.forget(address)

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _follow(self, address: str) -> None:
        channel = self._tls.aio_channel(address, options=self._channel_options)
        stub = kv_events_pb2_grpc.KvEventServiceStub(channel)
        try:
            while True:
                await self._read(address, stub)
                self._index.forget(address)
                await asyncio.sleep(self._retry_interval_s)
        finally:
            self._index.forget(address)
            await channel.close()

    async def _read(self, address: str, stub) -> None:
        try:
            async for message in stub.SubscribeKvEvents(kv_events_pb2.SubscribeKvEventsRequest()):
                self._index.apply(address, kv_event_update_from_proto(message))
        except grpc.aio.AioRpcError as exc:
            logger.debug("kv events from %s ended: %s", address, exc.code())
        except ValueError as exc:
            logger.warning("kv events from %s: bad message (%s); resubscribing", address, exc)

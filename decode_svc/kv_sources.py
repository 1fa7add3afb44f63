"""The decode pod's view of prefill engines: their NIXL sources (fetched once per engine, cached), the
ReserveKv that lets a pull READ a hold, and the ReleaseKv confirmations that decide whether pulled KV may be used."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import grpc
from opentelemetry import context as otel_context

from decode_svc.transport_probe import ProbeResult, TransportProbe, derive_transport
from shared.engine.kv_transfer.handle import KvHandle, KvSource
from shared.engine.kv_transfer.nixl_consumer import OnReleaseResult
from shared.serving.server.grpc_server import SERVICE_CHANNEL_OPTIONS
from shared.serving.prefill_client import PrefillClient, PrefillClientConfig
from shared.serving.server.tls import TlsConfig

logger = logging.getLogger(__name__)

# A restarted prefill pod is back within seconds: reconnect at most a second after it is, or its
# holds would wait for their leases because the confirmations cannot reach it.
# How long a prefill engine whose KV path failed its check is recomputed for, before it is checked again
# (a firewall fixed meanwhile costs at most this long of recomputed prompts).
RECHECK_BROKEN_PATH_S = 30.0
_CHANNEL_OPTIONS = SERVICE_CHANNEL_OPTIONS


class KvSourceUnavailable(RuntimeError):
    """The prefill pod named in a handle cannot describe its KV memory (down, restarted, bad answer)."""


class KvSourceCache:
    """Channels to prefill pods by address, and their KV sources by engine id."""

    def __init__(self, config: PrefillClientConfig = PrefillClientConfig(), interceptors=(), *,
                 probe_port_range: str | None = None, tls: TlsConfig = TlsConfig(),
                 loop: asyncio.AbstractEventLoop | None = None):
        """probe_port_range: check the KV path to each new prefill engine with a probe READ (None: never).
        tls: how the channels to prefill pods connect. loop: the event loop the calls run on, which
        confirm_release (asked on the engine thread) hands its ReleaseKv to."""
        self._config = config
        self._loop = loop
        self._tls = tls
        self._interceptors = list(interceptors)
        self._probe_port_range = probe_port_range
        self._probe: TransportProbe | None = None
        self._transports: dict[str, str] = {}
        self._checked_engines: set[str] = set()  # probed with a conclusive result (or being probed now)
        # Engines whose KV path failed its check -> when to check it again; until then their handles are
        # not pulled (each pull would wait out its whole deadline), the prompt is recomputed at once.
        self._broken_until: dict[str, float] = {}
        self.on_probe_failure: Callable[[ProbeResult], None] | None = None  # set by the servicer (metrics)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._sources: dict[str, KvSource] = {}
        self._tasks: set[asyncio.Task] = set()
        # Set when tracing is on: the trace context a request's ReleaseKv runs in (None: none known).
        # Releases start on the engine thread, outside any request's context.
        self.release_context: Callable[[str], otel_context.Context | None] | None = None

    def use_interceptors(self, interceptors) -> None:
        """Client interceptors (tracing) for the channels opened from now on."""
        if self._channels:
            raise RuntimeError("interceptors must be set before the first channel is opened")
        self._interceptors = list(interceptors)

    def _client(self, address: str) -> PrefillClient:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._tls.aio_channel(address, options=_CHANNEL_OPTIONS, interceptors=self._interceptors)
            self._channels[address] = channel
        return PrefillClient(channel, self._config)

    async def get(self, handle: KvHandle) -> KvSource:
        """The handle's source; KvSourceUnavailable when its pod cannot describe it or its KV path is broken."""
        self._refuse_broken_path(handle)
        source = self._sources.get(handle.engine_id)
        if source is None:
            source = await self._describe(handle)
        if self._probe_port_range is not None and handle.engine_id not in self._checked_engines:
            # Before the pull, while prefill holds this request's blocks: only then does its engine loop
            # drive UCX, which a READ over TCP needs from the side being read. Once per engine; a blocked
            # path costs this request the probe's timeout.
            self._checked_engines.add(handle.engine_id)
            await self._check_transport(handle, source)
            self._refuse_broken_path(handle)
        return source

    def _refuse_broken_path(self, handle: KvHandle) -> None:
        broken_until = self._broken_until.get(handle.engine_id)
        if broken_until is None:
            return
        if time.monotonic() >= broken_until:  # time to check it again
            del self._broken_until[handle.engine_id]
            self._checked_engines.discard(handle.engine_id)
            return
        raise KvSourceUnavailable(f"the KV path to prefill engine {handle.engine_id} at {handle.source_address} "
                                  f"failed its check; its prompts are recomputed until a check passes")

    async def _describe(self, handle: KvHandle) -> KvSource:
        try:
            described = await self._client(handle.source_address).get_kv_source()
        except (grpc.aio.AioRpcError, ValueError) as exc:
            raise KvSourceUnavailable(f"GetKvSource from {handle.source_address} failed: {exc}") from exc
        if described.engine_id != handle.engine_id:
            raise KvSourceUnavailable(
                f"{handle.source_address} now runs engine {described.engine_id}, not {handle.engine_id}"
            )
        self._sources[handle.engine_id] = described.source
        self._transports[handle.engine_id] = derive_transport(described.source, handle.source_address)
        return described.source

    def transport_of(self, handle: KvHandle) -> str:
        """The UCX transport pulls from this handle's engine take ("unknown" before it was met)."""
        return self._transports.get(handle.engine_id, "unknown")

    def open_probe(self) -> None:
        """Start the probe's NIXL agent. Call once the pod's UCX environment is set (UCX reads the port
        range when an agent starts) and before the pod serves: starting an agent stalls the whole process
        for up to seconds, which mid-request would delay every pull and ReleaseKv of this pod."""
        if self._probe_port_range is not None and self._probe is None:
            self._probe = TransportProbe(self._probe_port_range)

    async def _check_transport(self, handle: KvHandle, source: KvSource) -> None:
        """First meeting with a prefill engine: one probe READ (on a worker thread: it may wait seconds)."""
        loop = asyncio.get_running_loop()
        if self._probe is None:  # not opened at start-up
            self._probe = await loop.run_in_executor(None, TransportProbe, self._probe_port_range)
        result = await loop.run_in_executor(None, self._probe.probe, source, handle.source_address,
                                            self._transports[handle.engine_id])
        if not result.is_ok and not await self._answers(handle.source_address):
            # A frozen or stopping pod does not serve READs either: that says nothing of the transport.
            logger.warning("KV transport check to prefill engine %s at %s inconclusive: the pod answers neither "
                           "the READ (%s) nor gRPC; checked again at the next request from it",
                           handle.engine_id, handle.source_address, result.error)
            self._checked_engines.discard(handle.engine_id)
            return
        TransportProbe.report(result, handle.engine_id)
        if not result.is_ok:
            self._broken_until[handle.engine_id] = time.monotonic() + RECHECK_BROKEN_PATH_S
            if self.on_probe_failure is not None:
                self.on_probe_failure(result)

    async def _answers(self, address: str) -> bool:
        """Whether the prefill pod at address answers a gRPC call now."""
        try:
            await self._client(address).get_kv_source()
            return True
        except (grpc.aio.AioRpcError, ValueError):
            return False

    async def reserve(self, handle: KvHandle, request_id: str, prompt_digest: bytes) -> bool:
        """Whether the handle's prefill pod lets this request READ its hold (the first to ask, while the hold
        stands); KvSourceUnavailable when the pod cannot be asked."""
        try:
            return await self._client(handle.source_address).reserve_kv(request_id, handle.engine_id, prompt_digest)
        except grpc.aio.AioRpcError as exc:
            raise KvSourceUnavailable(f"ReserveKv at {handle.source_address} failed: {exc.code().name}") from exc

    def confirm_release(self, handle: KvHandle, request_id: str, prompt_digest: bytes, on_result: OnReleaseResult) -> None:
        """The decode connector's confirmation of a pull, asked on the engine thread: ReleaseKv runs on the
        event loop, and on_result(request_id, intact) gets its answer (intact None: no answer)."""
        if self._loop is None:
            raise RuntimeError("KvSourceCache was built without the event loop its confirmations run on")
        self._loop.call_soon_threadsafe(self._start_release, handle, request_id, prompt_digest, on_result)

    def release_quietly(self, handle: KvHandle, request_id: str) -> None:
        """Abandon a hold whose data will not be used (no digest, no answer needed)."""
        self._start_release(handle, request_id, b"", None)

    def _start_release(self, handle: KvHandle, request_id: str, prompt_digest: bytes,
                       on_result: OnReleaseResult | None) -> None:
        task = asyncio.ensure_future(self._release(handle, request_id, prompt_digest, on_result))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _release(self, handle: KvHandle, request_id: str, prompt_digest: bytes,
                       on_result: OnReleaseResult | None) -> None:
        intact: bool | None = None  # unknown until the prefill pod answers
        token = None
        try:
            context = self.release_context(request_id) if self.release_context is not None else None
            token = otel_context.attach(context) if context is not None else None
            intact = await self._client(handle.source_address).release_kv(request_id, handle.engine_id, prompt_digest)
        except grpc.aio.AioRpcError as exc:
            logger.warning("ReleaseKv(%s) at %s failed: %s", request_id, handle.source_address, exc.code())
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN):
                self._sources.pop(handle.engine_id, None)  # the engine may be gone; describe it afresh
        except Exception:  # noqa: BLE001 - unforeseen: logged, and answered as "no answer" below
            logger.exception("ReleaseKv(%s) at %s failed", request_id, handle.source_address)
        finally:
            if token is not None:
                otel_context.detach(token)
            # On every path, a cancelled call (shutdown) included: the decode connector keeps the pull, its
            # request and its blocks until this answer comes, so a path without it would strand them.
            if on_result is not None:
                on_result(request_id, intact)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for channel in self._channels.values():
            await channel.close()
        if self._probe is not None:
            self._probe.close()

"""The one client of PrefillService, used by the router (Prefill, ReleaseKv) and by decode pods
(GetKvSource, ReserveKv, ReleaseKv): domain types in and out, and one timeout policy for the pod-to-pod calls."""
from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from proto.pdserve.v1 import prefill_pb2, prefill_pb2_grpc
from shared.engine.request import SamplingParams
from shared.serving.wire.prefill import kv_source_from_proto, prefill_request_to_proto, prefill_result_from_proto
from shared.serving.wire import payloads as wire
from shared.serving.server.settings import setting


@dataclass(frozen=True)
class PrefillClientConfig:
    """Timeouts of the calls a peer makes to a prefill pod outside a client's request deadline."""

    prefill_rpc_timeout_s: float = field(default=5.0, metadata=setting(
        "seconds a GetKvSource, ReserveKv or ReleaseKv call to a prefill pod may take", flag="--prefill-rpc-timeout",
    ))

    def __post_init__(self) -> None:
        if not self.prefill_rpc_timeout_s > 0:
            raise ValueError(f"prefill_rpc_timeout_s must be > 0, got {self.prefill_rpc_timeout_s}")


class PrefillClient:
    """PrefillService calls on one channel. Raises grpc.aio.AioRpcError when a call fails, and
    ValueError when a prefill pod answers with something malformed."""

    def __init__(self, channel: grpc.aio.Channel, config: PrefillClientConfig = PrefillClientConfig()):
        self._stub = prefill_pb2_grpc.PrefillServiceStub(channel)
        self._timeout_s = config.prefill_rpc_timeout_s

    async def prefill(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams, *, timeout_s: float | None
    ) -> wire.PrefillResult:
        """timeout_s: what is left of the client's deadline (the prompt's compute is part of the request)."""
        message = prefill_request_to_proto(request_id, prompt_token_ids, sampling)
        return prefill_result_from_proto(await self._stub.Prefill(message, timeout=timeout_s))

    async def get_kv_source(self) -> wire.PrefillKvSource:
        answer = await self._stub.GetKvSource(prefill_pb2.GetKvSourceRequest(), timeout=self._timeout_s)
        return kv_source_from_proto(answer)

    async def reserve_kv(self, request_id: str, engine_id: str, prompt_digest: bytes) -> bool:
        """Whether this caller may READ the hold (the first to ask, while it stands, for its prompt)."""
        message = prefill_pb2.ReserveKvRequest(request_id=request_id, engine_id=engine_id, prompt_digest=prompt_digest)
        answer = await self._stub.ReserveKv(message, timeout=self._timeout_s)
        return answer.reserved

    async def release_kv(self, request_id: str, engine_id: str, prompt_digest: bytes = b"") -> bool:
        """Ends the hold; True when it was still intact and made for the prompt whose digest is given
        (the data pulled for it is good). Without a digest the hold is abandoned."""
        message = prefill_pb2.ReleaseKvRequest(request_id=request_id, engine_id=engine_id, prompt_digest=prompt_digest)
        answer = await self._stub.ReleaseKv(message, timeout=self._timeout_s)
        return answer.intact

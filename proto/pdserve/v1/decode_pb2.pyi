from proto.pdserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KvPullOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_PULL_OUTCOME_UNSPECIFIED: _ClassVar[KvPullOutcome]
    KV_PULL_OUTCOME_PULLED: _ClassVar[KvPullOutcome]
    KV_PULL_OUTCOME_PREFIX_CACHE_HIT: _ClassVar[KvPullOutcome]
    KV_PULL_OUTCOME_RECOMPUTED_LEASE_EXPIRED: _ClassVar[KvPullOutcome]
    KV_PULL_OUTCOME_RECOMPUTED_ERROR: _ClassVar[KvPullOutcome]
    KV_PULL_OUTCOME_RECOMPUTED_LAYOUT_MISMATCH: _ClassVar[KvPullOutcome]
    KV_PULL_OUTCOME_NO_HANDLE: _ClassVar[KvPullOutcome]
KV_PULL_OUTCOME_UNSPECIFIED: KvPullOutcome
KV_PULL_OUTCOME_PULLED: KvPullOutcome
KV_PULL_OUTCOME_PREFIX_CACHE_HIT: KvPullOutcome
KV_PULL_OUTCOME_RECOMPUTED_LEASE_EXPIRED: KvPullOutcome
KV_PULL_OUTCOME_RECOMPUTED_ERROR: KvPullOutcome
KV_PULL_OUTCOME_RECOMPUTED_LAYOUT_MISMATCH: KvPullOutcome
KV_PULL_OUTCOME_NO_HANDLE: KvPullOutcome

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "generated_token_ids", "sampling", "handle")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    generated_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    handle: _common_pb2.KvHandle
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., generated_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., handle: _Optional[_Union[_common_pb2.KvHandle, _Mapping]] = ...) -> None: ...

class KvPullStats(_message.Message):
    __slots__ = ("num_bytes", "num_blocks", "num_cached_blocks", "seconds", "outcome")
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    num_bytes: int
    num_blocks: int
    num_cached_blocks: int
    seconds: float
    outcome: KvPullOutcome
    def __init__(self, num_bytes: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_cached_blocks: _Optional[int] = ..., seconds: _Optional[float] = ..., outcome: _Optional[_Union[KvPullOutcome, str]] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("token_ids", "finish_reason", "kv_pull", "logprobs", "prompt_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    KV_PULL_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: _common_pb2.FinishReason
    kv_pull: KvPullStats
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., kv_pull: _Optional[_Union[KvPullStats, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

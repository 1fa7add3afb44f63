from proto.pdserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MemoryKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEMORY_KIND_UNSPECIFIED: _ClassVar[MemoryKind]
    MEMORY_KIND_DRAM: _ClassVar[MemoryKind]
    MEMORY_KIND_VRAM: _ClassVar[MemoryKind]
MEMORY_KIND_UNSPECIFIED: MemoryKind
MEMORY_KIND_DRAM: MemoryKind
MEMORY_KIND_VRAM: MemoryKind

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "finish_reason", "handle", "num_prompt_tokens", "first_token_logprobs", "resolved_sampling", "prompt_logprobs")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RESOLVED_SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    finish_reason: _common_pb2.FinishReason
    handle: _common_pb2.KvHandle
    num_prompt_tokens: int
    first_token_logprobs: _common_pb2.TokenLogprobs
    resolved_sampling: _common_pb2.SamplingParams
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    def __init__(self, first_token_id: _Optional[int] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., handle: _Optional[_Union[_common_pb2.KvHandle, _Mapping]] = ..., num_prompt_tokens: _Optional[int] = ..., first_token_logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ..., resolved_sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class GetKvSourceRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MemoryRegion(_message.Message):
    __slots__ = ("address", "length", "device_id")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    address: int
    length: int
    device_id: int
    def __init__(self, address: _Optional[int] = ..., length: _Optional[int] = ..., device_id: _Optional[int] = ...) -> None: ...

class GetKvSourceResponse(_message.Message):
    __slots__ = ("engine_id", "agent_name", "agent_metadata", "layout", "regions", "block_bytes", "num_blocks", "memory_kind")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_KIND_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    agent_name: str
    agent_metadata: bytes
    layout: _common_pb2.KvLayout
    regions: _containers.RepeatedCompositeFieldContainer[MemoryRegion]
    block_bytes: int
    num_blocks: int
    memory_kind: MemoryKind
    def __init__(self, engine_id: _Optional[str] = ..., agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., layout: _Optional[_Union[_common_pb2.KvLayout, _Mapping]] = ..., regions: _Optional[_Iterable[_Union[MemoryRegion, _Mapping]]] = ..., block_bytes: _Optional[int] = ..., num_blocks: _Optional[int] = ..., memory_kind: _Optional[_Union[MemoryKind, str]] = ...) -> None: ...

class ReserveKvRequest(_message.Message):
    __slots__ = ("request_id", "engine_id", "prompt_digest")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    engine_id: str
    prompt_digest: bytes
    def __init__(self, request_id: _Optional[str] = ..., engine_id: _Optional[str] = ..., prompt_digest: _Optional[bytes] = ...) -> None: ...

class ReserveKvResponse(_message.Message):
    __slots__ = ("reserved",)
    RESERVED_FIELD_NUMBER: _ClassVar[int]
    reserved: bool
    def __init__(self, reserved: _Optional[bool] = ...) -> None: ...

class ReleaseKvRequest(_message.Message):
    __slots__ = ("request_id", "engine_id", "prompt_digest")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    engine_id: str
    prompt_digest: bytes
    def __init__(self, request_id: _Optional[str] = ..., engine_id: _Optional[str] = ..., prompt_digest: _Optional[bytes] = ...) -> None: ...

class ReleaseKvResponse(_message.Message):
    __slots__ = ("intact",)
    INTACT_FIELD_NUMBER: _ClassVar[int]
    intact: bool
    def __init__(self, intact: _Optional[bool] = ...) -> None: ...

"""The only proto <-> domain mapping, gathered under one name for the services (`convert.X`): each proto
file's mapping lives in its own module beside this one. Every `*_from_proto` validates and raises ValueError
with a message that says what is wrong, so a servicer can map it straight to INVALID_ARGUMENT."""
from __future__ import annotations

# The domain types the mapping speaks of, for callers that name them through convert.
from shared.engine.kv_transfer.handle import KvHandle, KvLayout, KvPullOutcome, KvPullStats  # noqa: F401
from shared.serving.wire.common import (
    UINT32_MAX, UINT64_MAX, MAX_POD_REQUEST_ID_LENGTH, finish_reason_to_proto, finish_reason_from_proto,
    sampling_params_to_proto, sampling_params_from_proto, token_logprobs_to_proto,
    token_logprobs_from_proto, token_ids_from_proto, kv_layout_to_proto, kv_layout_from_proto,
    kv_handle_to_proto, kv_handle_from_proto, load_report_to_proto, load_report_from_proto,
)  # noqa: F401
from shared.serving.wire.prefill import (
    kv_source_to_proto, kv_source_from_proto, prefill_request_to_proto, prefill_request_from_proto,
    prefill_result_to_proto, prefill_result_from_proto,
)  # noqa: F401
from shared.serving.wire.decode import (
    kv_pull_stats_to_proto, kv_pull_stats_from_proto, decode_request_to_proto, decode_request_from_proto,
    check_not_past_max_tokens, decode_chunk_to_proto, decode_chunk_from_proto,
)  # noqa: F401
from shared.serving.wire.generate import (
    generate_prompt_from_proto, generate_input_from_proto, generate_chunk_to_proto,
)  # noqa: F401
from shared.serving.wire.kv_events import (
    BLOCK_HASH_BYTES, kv_event_update_to_proto, kv_event_update_from_proto,
)  # noqa: F401

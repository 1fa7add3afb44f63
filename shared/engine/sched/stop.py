"""Stop conditions: append sampled tokens to a request up to the first stop token or length cap."""
from __future__ import annotations

from shared.engine.request import Request, RequestStatus

_STOPPED = RequestStatus.FINISHED_STOPPED
_LENGTH = RequestStatus.FINISHED_LENGTH_CAPPED


def append_and_check_stop(request: Request, sampled: list[int], max_model_len: int) -> list[int]:
    """Append sampled tokens up to the first stop; return the tokens kept (and set the finished status)."""
    stop_ids = request.stop_ids
    if len(sampled) == 1:
        token = sampled[0]
        request.append_output_token_id(token)
        if token in stop_ids:
            _set_stopped(request, token)
        elif request.num_output_tokens >= request.max_tokens or request.num_tokens >= max_model_len:
            request.status = _LENGTH
        return sampled
    kept = []
    for token in sampled:
        request.append_output_token_id(token)
        kept.append(token)
        if token in stop_ids:
            _set_stopped(request, token)
            break
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= max_model_len:
            request.status = _LENGTH
            break
    return kept


def _set_stopped(request: Request, token: int) -> None:
    request.status = _STOPPED
    # EOS is the natural end: no stop reason. A stop token is reported as the reason.
    if token == request.eos_token_id and not request.sampling_params.ignore_eos:
        request.stop_reason = None
    else:
        request.stop_reason = token

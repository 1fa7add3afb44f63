"""The one error table: each named error ends a call with one gRPC code and one outcome label, and the
router labels a status code the way the pods label the error behind it."""
import grpc
import pytest

from shared.serving.pod.engine_thread import EngineStopped
from shared.serving.server.metrics import ServiceMetrics
from shared.serving.pod.outcomes import (
    OUTCOMES, DuplicateRequestId, InvalidRequest, KvUnusable, PodOverloaded, PodUnavailable, STATUS_TABLE,
    invalid_on_value_error, outcome_of_code, status_of,
)


@pytest.mark.parametrize("error, code, outcome", [
    (InvalidRequest("prompt is empty"), grpc.StatusCode.INVALID_ARGUMENT, "invalid"),
    (DuplicateRequestId("r1 is already in flight"), grpc.StatusCode.ALREADY_EXISTS, "invalid"),
    (PodOverloaded("1024 in flight"), grpc.StatusCode.RESOURCE_EXHAUSTED, "overloaded"),
    (PodUnavailable("shutting down"), grpc.StatusCode.UNAVAILABLE, "error"),
    (EngineStopped("engine loop crashed"), grpc.StatusCode.UNAVAILABLE, "error"),
    (KvUnusable("lease expired, policy fail"), grpc.StatusCode.FAILED_PRECONDITION, "error"),
])
def test_each_named_error_has_one_status_and_one_outcome(error, code, outcome):
    assert status_of(error) == (code, outcome)


def test_no_error_maps_to_aborted_and_every_label_is_exported():
    codes = {code for code, _ in STATUS_TABLE.values()}
    assert grpc.StatusCode.ABORTED not in codes
    assert {label for _, label in STATUS_TABLE.values()} <= set(OUTCOMES)
    metrics = ServiceMetrics()
    for label in OUTCOMES:
        metrics.record_outcome(label)  # every label is one the pods' counter accepts


def test_the_router_labels_a_status_code_as_the_pods_label_its_error():
    for code, label in STATUS_TABLE.values():
        expected = "error" if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION) else label
        assert outcome_of_code(code) == expected
    assert outcome_of_code(grpc.StatusCode.DEADLINE_EXCEEDED) == "deadline_exceeded"
    assert outcome_of_code(grpc.StatusCode.CANCELLED) == "cancelled"
    assert outcome_of_code(grpc.StatusCode.INTERNAL) == "error"


def test_only_input_checks_turn_a_value_error_into_invalid_request():
    with pytest.raises(InvalidRequest, match="token id 9 is out of range"):
        with invalid_on_value_error():
            raise ValueError("token id 9 is out of range")
    with pytest.raises(KeyError):
        with invalid_on_value_error():
            raise KeyError("not an input check")
    with pytest.raises(ValueError) as outside:
        raise ValueError("an internal bug")
    assert not isinstance(outside.value, InvalidRequest)

"""The queue-time prediction behind --max-queue-time: no wait predicted before the pod measured itself, and
a wait that grows with the requests in flight and shrinks as the pod finishes requests faster."""
import pytest

from shared.serving.queue_time import WaitPredictor


def _busy(predictor: WaitPredictor, *, num_steps: int, step_s: float, finished_per_step: int) -> None:
    for _ in range(num_steps):
        predictor.observe_step(step_s, finished_per_step)


def test_no_wait_is_predicted_before_enough_requests_finished():
    predictor = WaitPredictor()
    _busy(predictor, num_steps=3, step_s=0.1, finished_per_step=1)
    assert predictor.finish_rate is None
    assert predictor.predicted_wait_s(num_in_flight=1000) == 0.0


def test_the_requests_in_flight_drain_at_the_measured_rate():
    predictor = WaitPredictor()
    _busy(predictor, num_steps=200, step_s=0.05, finished_per_step=1)  # 20 requests per busy second
    assert predictor.finish_rate == pytest.approx(20.0, rel=1e-6)
    assert predictor.predicted_wait_s(num_in_flight=0) == 0.0
    assert predictor.predicted_wait_s(num_in_flight=10) == pytest.approx(0.5, rel=1e-6)


def test_idle_time_keeps_the_measurement():
    predictor = WaitPredictor()
    _busy(predictor, num_steps=200, step_s=0.05, finished_per_step=1)
    before = predictor.predicted_wait_s(num_in_flight=10)
    # No step runs while the pod idles: a burst after a lull meets the rate the pod last showed.
    assert predictor.predicted_wait_s(num_in_flight=10) == before


def test_the_prediction_follows_a_pod_that_batches_more_or_slows_down():
    predictor = WaitPredictor()
    _busy(predictor, num_steps=200, step_s=0.05, finished_per_step=1)
    _busy(predictor, num_steps=800, step_s=0.1, finished_per_step=8)  # 80 busy seconds of bigger batches
    assert predictor.finish_rate == pytest.approx(80.0, rel=0.02)
    _busy(predictor, num_steps=400, step_s=0.2, finished_per_step=1)  # then 80 busy seconds of a slow pod
    assert predictor.finish_rate == pytest.approx(5.0, rel=0.1)


def test_after_a_burst_of_big_batches_the_rate_follows_the_small_ones_within_seconds():
    """A burst (64 at once) leaves a high rate behind; the overload an admission budget then serves runs a few
    requests at a time, which finish far fewer per second. Within a few busy seconds the prediction is that
    of the small batches, not the burst's, which would let in several times the budget."""
    predictor = WaitPredictor()
    _busy(predictor, num_steps=100, step_s=0.1, finished_per_step=3)  # 10 busy seconds at 30 per second
    _busy(predictor, num_steps=40, step_s=0.1, finished_per_step=1)  # then 4 at 10 per second
    assert predictor.finish_rate < 1.6 * 10.0  # 10 s of memory: 2.2 times, letting in 2.2 times the budget

"""The queue-time prediction behind --max-queue-time: no wait while a request joins the running batch or
before the pod measured itself, and a wait that grows with the requests ahead as Little's law says."""
import pytest

from shared.serving.queue_time import WaitPredictor


def _busy(predictor: WaitPredictor, *, num_steps: int, step_s: float, batch: int, finished_per_step: int) -> None:
    for _ in range(num_steps):
        predictor.observe_step(step_s, batch, finished_per_step)


def test_no_wait_is_predicted_before_enough_requests_finished():
    predictor = WaitPredictor(max_num_seqs=8)
    _busy(predictor, num_steps=3, step_s=0.1, batch=8, finished_per_step=1)
    assert predictor.seconds_per_request is None
    assert predictor.predicted_wait_s(num_in_flight=1000) == 0.0


def test_a_request_that_joins_the_running_batch_waits_nothing():
    predictor = WaitPredictor(max_num_seqs=8)
    _busy(predictor, num_steps=40, step_s=0.05, batch=8, finished_per_step=1)
    assert predictor.predicted_wait_s(num_in_flight=7) == 0.0


def test_the_wait_beyond_the_batch_follows_littles_law():
    predictor = WaitPredictor(max_num_seqs=8)
    # 8 side by side, one finishing every 0.05 s step: each cost 8 x 0.05 = 0.4 request-seconds.
    _busy(predictor, num_steps=200, step_s=0.05, batch=8, finished_per_step=1)
    assert predictor.seconds_per_request == pytest.approx(0.4, rel=1e-6)
    # 8 running + 8 waiting: the 9th one ahead of the batch leaves after 9 places freed, 0.05 s each.
    assert predictor.predicted_wait_s(num_in_flight=16) == pytest.approx(9 * 0.05, rel=1e-6)
    assert predictor.predicted_wait_s(num_in_flight=32) > predictor.predicted_wait_s(num_in_flight=16)


def test_the_batch_is_the_largest_one_the_pod_ran_recently():
    predictor = WaitPredictor(max_num_seqs=128)
    _busy(predictor, num_steps=100, step_s=0.05, batch=4, finished_per_step=1)  # never more than 4 at once
    assert predictor.predicted_wait_s(num_in_flight=3) == 0.0
    assert predictor.predicted_wait_s(num_in_flight=8) == pytest.approx(5 * 0.2 / 4, rel=1e-6)


def test_measurements_follow_a_slower_pod():
    predictor = WaitPredictor(max_num_seqs=8)
    _busy(predictor, num_steps=200, step_s=0.05, batch=8, finished_per_step=1)
    fast = predictor.predicted_wait_s(num_in_flight=16)
    _busy(predictor, num_steps=400, step_s=0.2, batch=8, finished_per_step=1)  # 80 busy seconds later
    assert predictor.predicted_wait_s(num_in_flight=16) == pytest.approx(4 * fast, rel=0.05)

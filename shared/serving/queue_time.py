"""How long a request arriving now would wait for the requests ahead of it on its pod: predicted from the
requests in flight and the rate at which the engine measured itself finishing requests while busy
(--max-queue-time refuses past it)."""
from __future__ import annotations

# The measurements fade over this much busy time (idle time keeps them): the prediction follows a pod whose
# load or batch changes within seconds, and survives a lull. The rate depends on the batch the pod runs (a
# burst's big batches finish far more requests per second than the few an admission budget lets in): a
# longer memory keeps a burst's rate through an overload that follows and lets in several times the budget.
HALF_LIFE_S = 2.0
# Fewer finished requests than this (faded) say too little: predict no wait rather than refuse on noise.
MIN_FINISHED = 4.0


class WaitPredictor:
    """The requests in flight drain at the rate the pod finishes requests while it computes (finished
    requests per busy second, the batching it reaches included), so one more request waits about
    num_in_flight / rate for its turn; that rate rises as the pod batches more, up to its capacity.

    observe_step() runs on the engine thread, predicted_wait_s() on the event loop: plain floats, each
    written by one thread only."""

    def __init__(self) -> None:
        self._busy_s = 0.0
        self._num_finished = 0.0

    def observe_step(self, seconds: float, num_finished: int) -> None:
        """One engine step that computed something: how long it took and how many requests it finished."""
        fade = 0.5 ** (seconds / HALF_LIFE_S)
        self._busy_s = self._busy_s * fade + seconds
        self._num_finished = self._num_finished * fade + num_finished

    @property
    def finish_rate(self) -> float | None:
        """Requests finished per busy second (None until enough requests finished)."""
        if self._num_finished < MIN_FINISHED or self._busy_s <= 0:
            return None
        return self._num_finished / self._busy_s

    def predicted_wait_s(self, num_in_flight: int) -> float:
        """The wait of one more request behind num_in_flight requests (running or queued); 0 before the pod
        measured itself."""
        rate = self.finish_rate
        return 0.0 if rate is None else num_in_flight / rate

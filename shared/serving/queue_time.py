"""How long a request arriving now would wait before its pod starts it: predicted from the requests ahead
of it and the service time the engine measured on its recent steps (--max-queue-time refuses past it)."""
from __future__ import annotations

# The measurements fade over this much busy time (idle time keeps them): the prediction follows a pod whose
# load or batch changes within seconds, and survives a lull.
HALF_LIFE_S = 10.0
# Fewer finished requests than this (faded) say too little: predict no wait rather than refuse on noise.
MIN_FINISHED = 4.0
# How fast the largest batch seen fades per step: the parallelism a pod showed recently.
PEAK_FADE_PER_STEP = 0.999


class WaitPredictor:
    """Little's law over the engine's own steps. Each finished request cost S request-seconds of the batch
    (the sum over steps of running requests x step time, per finished request); a batch of B requests
    side by side then frees a place every S / B seconds, so the k-th request beyond the batch waits about
    k x S / B. B is the largest batch the pod ran recently (at most max_num_seqs).

    observe_step() runs on the engine thread, predicted_wait_s() on the event loop: plain floats, each
    written by one thread only."""

    def __init__(self, max_num_seqs: int):
        self._max_num_seqs = max_num_seqs
        self._request_seconds = 0.0
        self._num_finished = 0.0
        self._peak_running = 0.0

    def observe_step(self, seconds: float, num_running: int, num_finished: int) -> None:
        """One engine step that computed something: how long it took, how many requests it ran, how many ended."""
        fade = 0.5 ** (seconds / HALF_LIFE_S)
        self._request_seconds = self._request_seconds * fade + seconds * num_running
        self._num_finished = self._num_finished * fade + num_finished
        self._peak_running = max(float(num_running), self._peak_running * PEAK_FADE_PER_STEP)

    @property
    def seconds_per_request(self) -> float | None:
        """S: request-seconds of the batch per finished request (None until enough requests finished)."""
        if self._num_finished < MIN_FINISHED:
            return None
        return self._request_seconds / self._num_finished

    def predicted_wait_s(self, num_in_flight: int) -> float:
        """The wait of one more request, with num_in_flight requests (running or queued) already on the pod;
        0 while it would join the running batch at once, or before the pod measured itself."""
        seconds_per_request = self.seconds_per_request
        batch = max(1.0, min(float(self._max_num_seqs), self._peak_running or float(self._max_num_seqs)))
        num_ahead = num_in_flight + 1 - batch
        if seconds_per_request is None or num_ahead <= 0:
            return 0.0
        return num_ahead * seconds_per_request / batch

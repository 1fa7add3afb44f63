"""A decode pod exports pdserve_kv_transport_failures_total for every transport from its start, at 0, so an
alert on its rate sees a series (and 0) before the first failure rather than no data."""
from prometheus_client import generate_latest

from decode_svc.servicer import DecodeServicer
from decode_svc.transport_probe import TRANSPORT_NAMES
from shared.serving.server.metrics import ServiceMetrics


class _Sources:
    on_probe_failure = None


def test_transport_failures_have_a_zero_series_per_transport_from_the_start():
    metrics = ServiceMetrics()
    sources = _Sources()
    DecodeServicer(metrics, sources)
    text = generate_latest(metrics.registry).decode()
    for transport in TRANSPORT_NAMES:
        assert f'pdserve_kv_transport_failures_total{{transport="{transport}"}} 0.0' in text
    sources.on_probe_failure(type("Result", (), {"transport": "tcp"})())
    assert 'pdserve_kv_transport_failures_total{transport="tcp"} 1.0' in generate_latest(metrics.registry).decode()

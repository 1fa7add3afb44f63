"""pdserve bench: percentile and summary math, the token timeline, the seeded workload, goodput, and
one short run against a real colocated server process on 127.0.0.1."""
import json
import math

import numpy as np
import pytest

from pdserve import bench
from pdserve.bench_stats import RequestRecord, Slo, build_report, percentile, summarize, token_timeline


# ---- statistics ------------------------------------------------------------------------------


@pytest.mark.parametrize("values", [[5.0], [3.0, 1.0], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [0.3, 9.1, 2.2, 2.2, 7.0]])
@pytest.mark.parametrize("q", [0, 1, 50, 90, 99, 100])
def test_percentile_matches_linear_interpolation(values, q):
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_rejects_empty_and_out_of_range():
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
    with pytest.raises(ValueError, match="0, 100"):
        percentile([1.0], 101)


def test_summarize_scales_and_handles_empty():
    assert summarize([]) == {"mean": None, "p50": None, "p90": None, "p99": None}
    s = summarize([0.001, 0.002, 0.003, 0.004], scale=1000.0)
    assert s["mean"] == pytest.approx(2.5)
    assert s["p50"] == pytest.approx(2.5)
    assert s["p90"] == pytest.approx(3.7)
    assert s["p99"] == pytest.approx(3.97)


def test_token_timeline_spreads_multi_token_messages():
    # token 1 at 0.1 s, then one token at 0.2 s, then three tokens together at 0.5 s.
    ttft, gaps = token_timeline([(0.1, 1), (0.2, 1), (0.5, 3)])
    assert ttft == pytest.approx(0.1)
    assert gaps == pytest.approx([0.1, 0.1, 0.1, 0.1])
    assert sum(gaps) == pytest.approx(0.5 - 0.1)


def test_token_timeline_first_message_extras_and_empty_messages():
    ttft, gaps = token_timeline([(0.0, 0), (0.05, 2), (0.08, 0), (0.09, 1)])
    assert ttft == pytest.approx(0.05)
    assert gaps == pytest.approx([0.0, 0.04])
    assert token_timeline([]) == (None, [])


def _record(index, ttft, e2e, num_tokens, error=None):
    return RequestRecord(index, num_prompt_tokens=10, num_expected_output_tokens=num_tokens, ttft_s=ttft,
                         e2e_s=e2e, itl_s=[(e2e - ttft) / (num_tokens - 1)] * (num_tokens - 1) if num_tokens > 1
                         else [], num_output_tokens=num_tokens, error=error)


def test_tpot_is_mean_gap_after_first_token():
    assert _record(0, 0.1, 1.1, 11).tpot_s == pytest.approx(0.1)
    assert _record(0, 0.1, 0.1, 1).tpot_s is None


def test_report_throughput_failures_and_goodput():
    records = [
        _record(0, 0.020, 0.020 + 9 * 0.010, 10),  # meets both SLOs
        _record(1, 0.080, 0.080 + 9 * 0.010, 10),  # TTFT too slow
        _record(2, 0.020, 0.020 + 9 * 0.030, 10),  # TPOT too slow
        _record(3, 0.030, 0.030, 1),  # one token: no TPOT to miss
        RequestRecord(4, 10, 10, error="UNAVAILABLE: gone"),
    ]
    report = build_report(records, duration_s=2.0, slo=Slo(ttft_s=0.05, tpot_s=0.02))
    assert report["num_completed"] == 4 and report["num_failed"] == 1
    assert report["errors"] == ["UNAVAILABLE: gone"]
    assert report["total_output_tokens"] == 31
    assert report["output_throughput"] == pytest.approx(15.5)
    assert report["request_throughput"] == pytest.approx(2.0)
    assert report["num_slo_met"] == 2
    assert report["goodput"] == pytest.approx(1.0)
    assert report["ttft_ms"]["p50"] == pytest.approx(25.0)
    assert report["tpot_ms"]["mean"] == pytest.approx((10 + 10 + 30) / 3)
    # Without SLOs there is no goodput figure.
    assert build_report(records, 2.0, Slo())["goodput"] is None


def test_slo_rejects_non_positive():
    with pytest.raises(ValueError, match="ttft_s"):
        Slo(ttft_s=0.0)


# ---- workload --------------------------------------------------------------------------------


def test_workload_is_deterministic_and_in_bounds():
    config = bench.WorkloadConfig(num_requests=200, rate=8.0, input_len=128, output_len=64, range_ratio=0.5,
                                  vocab_size=4096, seed=0)
    first, again = bench.generate_workload(config), bench.generate_workload(config)
    assert first == again
    other = bench.generate_workload(bench.WorkloadConfig(num_requests=200, rate=8.0, seed=1))
    assert [r.prompt_token_ids for r in other] != [r.prompt_token_ids for r in first]
    assert all(64 <= len(r.prompt_token_ids) <= 192 for r in first)
    assert all(32 <= r.max_tokens <= 96 for r in first)
    assert all(3 <= t < 4096 for r in first for t in r.prompt_token_ids)
    # Both ends of the length ranges are reachable and the spread is wide.
    lengths = {len(r.prompt_token_ids) for r in first}
    assert min(lengths) < 75 and max(lengths) > 180
    arrivals = [r.arrival_s for r in first]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals)


def test_poisson_arrivals_have_the_requested_rate():
    requests = bench.generate_workload(bench.WorkloadConfig(num_requests=4000, rate=8.0, seed=3))
    mean_gap = requests[-1].arrival_s / (len(requests) - 1)
    assert mean_gap == pytest.approx(1 / 8.0, rel=0.06)


def test_infinite_rate_sends_everything_at_once():
    requests = bench.generate_workload(bench.WorkloadConfig(num_requests=10, rate=math.inf, range_ratio=0.0,
                                                            input_len=7, output_len=3))
    assert [r.arrival_s for r in requests] == [0.0] * 10
    assert {len(r.prompt_token_ids) for r in requests} == {7} and {r.max_tokens for r in requests} == {3}


@pytest.mark.parametrize("kwargs, message", [
    ({"num_requests": 0}, "num_requests"),
    ({"rate": 0.0}, "rate"),
    ({"range_ratio": 1.0}, "range_ratio"),
    ({"vocab_size": 3}, "vocab_size"),
    ({"input_len": 0}, "input_len"),
])
def test_workload_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        bench.WorkloadConfig(**kwargs)


def test_rate_flag_parsing():
    assert bench.parse_rate("inf") == math.inf
    assert bench.parse_rate("2.5") == 2.5
    with pytest.raises(Exception, match="rate"):
        bench.parse_rate("fast")
    with pytest.raises(Exception, match="rate"):
        bench.parse_rate("-1")


# ---- end to end --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def colocated_server(tmp_path_factory):
    from pdserve.launcher import HOST, free_port, start_service, wait_serving

    port, http_port = free_port(), free_port()
    service = start_service(
        "colocated", "colocated_svc",
        ["--host", HOST, "--port", str(port), "--model", "tiny", "--num-blocks", "256", "--http-port", str(http_port)],
        address=f"{HOST}:{port}", log_dir=tmp_path_factory.mktemp("logs"),
        env={"OMP_NUM_THREADS": "1"},
    )
    service.http_url = f"http://{HOST}:{http_port}/v1"
    try:
        wait_serving(service, timeout_s=90)
        yield service
    finally:
        service.stop()


@pytest.mark.timeout(120)
@pytest.mark.e2e
@pytest.mark.parametrize("backend", ["grpc", "openai"])
def test_bench_against_a_colocated_server(colocated_server, tmp_path, capsys, backend):
    target = colocated_server.http_url if backend == "openai" else colocated_server.address
    argv = ["--backend", backend, "--target", target, "--num-requests", "6", "--rate", "inf", "--input-len", "16",
            "--output-len", "6", "--range-ratio", "0.5", "--seed", "7", "--ttft-slo-ms", "60000",
            "--tpot-slo-ms", "60000", "--out-dir", str(tmp_path), "--label", "e2e test", "--no-plots"]
    assert bench.main(argv) == 0
    report = json.loads((tmp_path / "e2e_test.json").read_text())
    workload = bench.generate_workload(bench.WorkloadConfig(num_requests=6, input_len=16, output_len=6, seed=7))
    assert report["num_completed"] == 6 and report["num_failed"] == 0
    assert report["total_output_tokens"] == sum(r.max_tokens for r in workload)
    assert [row["num_output_tokens"] for row in report["requests"]] == [r.max_tokens for r in workload]
    assert report["num_slo_met"] == 6
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        s = report[key]
        assert 0 < s["p50"] <= s["p90"] <= s["p99"]
    assert report["ttft_ms"]["p99"] <= report["e2e_ms"]["p99"]
    assert "6 done, 0 failed" in capsys.readouterr().out


@pytest.mark.timeout(60)
@pytest.mark.e2e
def test_bench_counts_failures(colocated_server, tmp_path):
    # vocab 8192 > the tiny model's 4096: out-of-vocabulary prompts are refused with INVALID_ARGUMENT.
    argv = ["--target", colocated_server.address, "--num-requests", "3", "--input-len", "64", "--output-len", "2",
            "--vocab-size", "8192", "--num-warmups", "0", "--out-dir", str(tmp_path), "--label", "bad", "--no-plots"]
    assert bench.main(argv) == 1
    report = json.loads((tmp_path / "bad.json").read_text())
    assert report["num_failed"] == 3
    assert report["errors"] and all(e.startswith("INVALID_ARGUMENT") for e in report["errors"])
    # Through HTTP the same refusals are 400s.
    argv[1] = colocated_server.http_url
    assert bench.main(["--backend", "openai", *argv]) == 1
    report = json.loads((tmp_path / "bad.json").read_text())
    assert report["num_failed"] == 3 and all(e.startswith("HTTP 400") for e in report["errors"])


@pytest.mark.timeout(60)
@pytest.mark.e2e
def test_bench_with_no_server_exits_non_zero(tmp_path):
    from pdserve.launcher import free_port

    for backend, target in (("grpc", f"127.0.0.1:{free_port()}"), ("openai", f"http://127.0.0.1:{free_port()}/v1")):
        argv = ["--backend", backend, "--target", target, "--num-requests", "2", "--request-timeout-s", "5",
                "--out-dir", str(tmp_path), "--no-plots"]
        assert bench.main(argv) == 2

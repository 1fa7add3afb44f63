"""router.policy picks (least-loaded, round-robin, no-worker and overload reasons) and router.flags parsing."""

import pytest

from router import policy
from router.flags import RouterConfig, WorkerSpec, build_arg_parser, parse_worker_list, parse_worker_spec
from router.policy import NoPick, WorkerView
from shared.serving.wire.payloads import LoadReport


def view(address, healthy=True, waiting=0, running=0, free=10, total=10, overloaded=False, inflight=0, load=True):
    report = LoadReport(waiting, running, free, total, 0, overloaded) if load else None
    return WorkerView(address, healthy, report, inflight)


def test_least_loaded_prefers_fewest_requests():
    workers = [view("a:1", running=3), view("b:1", running=1), view("c:1", waiting=1, running=1)]
    assert policy.pick_least_loaded(workers).address == "b:1"


def test_least_loaded_counts_router_inflight_when_polls_are_stale():
    # Polls say all idle, but this router already has two calls open on a:1.
    workers = [view("a:1", inflight=2), view("b:1")]
    assert policy.pick_least_loaded(workers).address == "b:1"


def test_least_loaded_breaks_ties_on_free_blocks_then_address():
    assert policy.pick_least_loaded([view("a:1", free=2), view("b:1", free=9)]).address == "b:1"
    assert policy.pick_least_loaded([view("b:1"), view("a:1")]).address == "a:1"


def test_unknown_load_counts_as_idle():
    assert policy.pick_least_loaded([view("a:1", running=1), view("b:1", load=False)]).address == "b:1"


def test_unhealthy_overloaded_and_excluded_workers_are_skipped():
    workers = [view("a:1", healthy=False), view("b:1", overloaded=True), view("c:1", running=5)]
    assert policy.pick_least_loaded(workers).address == "c:1"
    assert policy.pick_least_loaded(workers, exclude={"c:1"}) == policy.Pick(None, NoPick.ALL_OVERLOADED)
    assert policy.pick_round_robin(workers, 7).address == "c:1"


def test_no_workers_vs_all_overloaded():
    assert policy.pick_least_loaded([]).reason is NoPick.NO_WORKERS
    assert policy.pick_least_loaded([view("a:1", healthy=False)]).reason is NoPick.NO_WORKERS
    assert policy.pick_round_robin([view("a:1", overloaded=True)], 0).reason is NoPick.ALL_OVERLOADED


def test_round_robin_cycles_in_address_order_ignoring_load():
    workers = [view("c:1"), view("a:1", running=100), view("b:1")]
    assert [policy.pick_round_robin(workers, turn).address for turn in range(6)] == ["a:1", "b:1", "c:1"] * 2


def test_pick_dispatches_on_policy_name():
    workers = [view("a:1", running=1), view("b:1")]
    assert policy.pick("least-loaded", workers, 0).address == "b:1"
    assert policy.pick("round-robin", workers, 0).address == "a:1"
    with pytest.raises(ValueError, match="unknown policy"):
        policy.pick("random", workers, 0)


def test_worker_spec_parsing():
    assert parse_worker_spec("10.0.0.1:50052") == WorkerSpec("10.0.0.1", 50052)
    assert parse_worker_spec("dns:prefill.default.svc:50052") == WorkerSpec("prefill.default.svc", 50052, True)
    assert parse_worker_spec("[::1]:9") == WorkerSpec("::1", 9)
    assert str(WorkerSpec("::1", 9)) == "[::1]:9"
    assert parse_worker_list(["a:1,b:2", "a:1", " c:3 "]) == (
        WorkerSpec("a", 1), WorkerSpec("b", 2), WorkerSpec("c", 3)
    )
    for bad in ("nohost", "host:", "host:0", "host:99999", ":5", "dns:name", "[::1]9"):
        with pytest.raises(ValueError, match="bad"):
            parse_worker_spec(bad)


def test_config_from_flags_and_validation():
    args = build_arg_parser().parse_args(
        ["--prefill", "a:1,b:2", "--decode", "dns:dec:3", "--policy", "round-robin", "--port", "0"]
    )
    config = RouterConfig.from_args(args)
    assert config.prefill == (WorkerSpec("a", 1), WorkerSpec("b", 2))
    assert config.decode == (WorkerSpec("dec", 3, True),)
    assert (config.policy, config.port, config.tokenizer_path, config.metrics_port) == ("round-robin", 0, None, None)
    with pytest.raises(ValueError, match="decode worker is required"):
        RouterConfig.from_args(build_arg_parser().parse_args(["--prefill", "a:1"]))
    with pytest.raises(ValueError, match="policy"):
        RouterConfig(prefill=config.prefill, decode=config.decode, policy="random")
    with pytest.raises(ValueError, match="max_prefill_retries"):
        RouterConfig(prefill=config.prefill, decode=config.decode, max_prefill_retries=-1)
    with pytest.raises(SystemExit):
        build_arg_parser().parse_args(["--policy", "random"])


# ---- KV-aware picks and conditional disaggregation ----------------------------------------------

def test_kv_aware_picks_the_worker_holding_the_prefix():
    workers = [view("a:1"), view("b:1")]
    weights = policy.KvWeights(prefix_weight=1.0, load_weight=64.0)
    assert policy.pick("kv-aware", workers, 0, num_prompt_tokens=400, cached_tokens={"b:1": 320},
                       weights=weights).address == "b:1"
    # Without cached tokens it is least-loaded (ties to the address).
    assert policy.pick_kv_aware(workers, 400, {}, weights).address == "a:1"


def test_kv_aware_weighs_the_prefix_against_load():
    workers = [view("a:1", running=4), view("b:1")]
    cached = {"a:1": 320}
    # 320 cached tokens outweigh 4 queued requests at 64 tokens each (256) ...
    assert policy.pick_kv_aware(workers, 400, cached, policy.KvWeights(1.0, 64.0)).address == "a:1"
    # ... but not at 100 each (400).
    assert policy.pick_kv_aware(workers, 400, cached, policy.KvWeights(1.0, 100.0)).address == "b:1"
    assert policy.pick_kv_aware(workers, 400, cached, policy.KvWeights(1.0, 64.0), exclude={"a:1"}).address == "b:1"
    assert policy.pick_kv_aware([view("a:1", overloaded=True)], 400, cached,
                                policy.KvWeights()).reason is NoPick.ALL_OVERLOADED


def test_short_uncached_suffix_goes_decode_only():
    rule = policy.DisaggregationRule(max_local_prefill_tokens=64)
    prefill, decode = [view("p:1")], view("d:1")
    skip = policy.decide_route(40, prefill, decode, rule)
    assert skip == policy.RouteDecision(policy.Route.DECODE_ONLY, policy.RouteReason.SHORT_UNCACHED_SUFFIX)
    assert policy.decide_route(64, prefill, decode, rule).route is policy.Route.SPLIT
    assert policy.decide_route(40, prefill, view("d:1", overloaded=True), rule).route is policy.Route.SPLIT
    assert policy.decide_route(40, prefill, None, rule).route is policy.Route.SPLIT
    assert policy.decide_route(0, prefill, decode, policy.DisaggregationRule()).route is policy.Route.SPLIT


def test_saturated_prefill_sends_work_to_an_unsaturated_decode_pod():
    rule = policy.DisaggregationRule(saturation_queue=4)
    busy = [view("p:1", waiting=5), view("p:2", overloaded=True), view("p:3", healthy=False)]
    decision = policy.decide_route(1000, busy, view("d:1", waiting=1), rule)
    assert decision == policy.RouteDecision(policy.Route.DECODE_ONLY, policy.RouteReason.PREFILL_SATURATED)
    assert policy.decide_route(1000, busy, view("d:1", waiting=4), rule).route is policy.Route.SPLIT
    assert policy.decide_route(1000, [*busy, view("p:4", waiting=3)], view("d:1"), rule).route is policy.Route.SPLIT
    off = policy.DisaggregationRule()
    assert policy.decide_route(1000, busy, view("d:1"), off).route is policy.Route.SPLIT


def test_kv_routing_flags():
    args = build_arg_parser().parse_args([
        "--prefill", "a:1", "--decode", "b:1", "--policy", "kv-aware", "--kv-prefix-weight", "2",
        "--kv-load-weight", "10", "--local-prefill-below", "48", "--prefill-saturation-queue", "3",
        "--kv-index-max-blocks", "1000",
    ])
    config = RouterConfig.from_args(args)
    assert config.kv_weights == policy.KvWeights(2.0, 10.0)
    assert config.disaggregation == policy.DisaggregationRule(48, 3)
    assert config.kv_index_max_blocks == 1000 and config.needs_kv_index
    default = RouterConfig.from_args(build_arg_parser().parse_args(["--prefill", "a:1", "--decode", "b:1"]))
    assert default.policy == "kv-aware" and default.needs_kv_index
    plain = RouterConfig.from_args(build_arg_parser().parse_args(
        ["--prefill", "a:1", "--decode", "b:1", "--policy", "least-loaded"]))
    assert not plain.needs_kv_index
    with pytest.raises(ValueError, match="max_local_prefill_tokens must be >= 0"):
        RouterConfig(prefill=plain.prefill, decode=plain.decode, disaggregation=policy.DisaggregationRule(-1, 0))

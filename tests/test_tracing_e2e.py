"""One trace per request across the three-process system (router, prefill pod, decode pod), exported
over OTLP/gRPC to a real receiver on 127.0.0.1: the span tree, its cross-process links and the KV
attributes."""
from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest

from pdserve.client import build_generate_request
from pdserve.launcher import LocalCluster
from proto.pdserve.v1 import generate_pb2_grpc, prefill_pb2_grpc
from shared.serving.wire.prefill import prefill_request_to_proto
from shared.engine.request import SamplingParams
from shared.serving.server.telemetry import SpanAttr
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan, children_of

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

BLOCK_SIZE = 16
MODEL_ARGS = ["--model", "tiny", "--seed", "0", "--block-size", str(BLOCK_SIZE), "--num-blocks", "256"]
LEASE_S = 3.0
# Export every 100 ms instead of every 5 s (the SDK's batch processor reads this standard variable).
FAST_EXPORT_ENV = {"OTEL_BSP_SCHEDULE_DELAY": "100"}
CLIENT_TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN_ID = "b7ad6b7169203331"

GENERATE = "pdserve.v1.GenerateService/Generate"
PREFILL = "pdserve.v1.PrefillService/Prefill"
DECODE = "pdserve.v1.DecodeService/Decode"
RELEASE_KV = "pdserve.v1.PrefillService/ReleaseKv"
GET_KV_SOURCE = "pdserve.v1.PrefillService/GetKvSource"
HTTP_COMPLETIONS = "POST /v1/completions"  # the HTTP front's server span (OpenTelemetry's HTTP naming)
# Every span a pulled request's trace must hold, by (name, kind, service).
EXPECTED = {
    (GENERATE, "SERVER", "pdserve-router"),
    ("route prefill", "INTERNAL", "pdserve-router"),
    ("route decode", "INTERNAL", "pdserve-router"),
    (PREFILL, "CLIENT", "pdserve-router"),
    (PREFILL, "SERVER", "pdserve-prefill"),
    ("prefill-queue", "INTERNAL", "pdserve-prefill"),
    ("prefill", "INTERNAL", "pdserve-prefill"),
    ("kv-hold", "INTERNAL", "pdserve-prefill"),
    (DECODE, "CLIENT", "pdserve-router"),
    (DECODE, "SERVER", "pdserve-decode"),
    ("kv-pull", "INTERNAL", "pdserve-decode"),
    ("decode-queue", "INTERNAL", "pdserve-decode"),
    ("decode", "INTERNAL", "pdserve-decode"),
    (RELEASE_KV, "CLIENT", "pdserve-decode"),
    (RELEASE_KV, "SERVER", "pdserve-prefill"),
}


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    with OtlpReceiver() as receiver:
        endpoint = ["--otlp-endpoint", receiver.endpoint]
        with LocalCluster.start(
            pod_args=[*MODEL_ARGS, *endpoint],
            prefill_args=["--lease-s", str(LEASE_S)],
            router_args=endpoint,
            env=FAST_EXPORT_ENV,
            log_dir=tmp_path_factory.mktemp("logs"),
        ) as cluster:
            yield cluster, receiver


def _generate(address: str, request_id: str, prompt: list[int], metadata=()) -> list[int]:
    request = build_generate_request(prompt, request_id=request_id, max_tokens=6, ignore_eos=True)
    with grpc.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        return [t for chunk in stub.Generate(request, timeout=60, metadata=metadata) for t in chunk.token_ids]


def _request_spans(spans: list[ReceivedSpan], request_id: str) -> list[ReceivedSpan]:
    """Spans that name the request (pods see the router's suffixed id, `request_id.xxxxxxxx`)."""
    return [
        span for span in spans
        if str(span.attributes.get(SpanAttr.REQUEST_ID, "")).split(".")[0] == request_id
    ]


def _expected(root: str) -> set[tuple[str, str, str]]:
    """EXPECTED, for a request that entered the router as `root` (gRPC Generate or an HTTP route)."""
    return {span for span in EXPECTED if span[0] != GENERATE} | {(root, "SERVER", "pdserve-router")}


def _trace_complete(spans: list[ReceivedSpan], request_id: str, root: str = GENERATE) -> bool:
    named = _request_spans(spans, request_id)
    if not named:
        return False
    trace = [span for span in spans if span.trace_id == named[0].trace_id]
    return _expected(root) <= {(span.name, span.kind, span.service_name) for span in trace}


def _one(spans: list[ReceivedSpan], name: str, kind: str) -> ReceivedSpan:
    found = [span for span in spans if span.name == name and span.kind == kind]
    assert len(found) == 1, f"expected one {kind} {name}, got {found}"
    return found[0]


def _child(spans: list[ReceivedSpan], parent: ReceivedSpan, name: str, kind: str = "INTERNAL") -> ReceivedSpan:
    return _one(children_of(spans, parent), name, kind)


def test_one_trace_per_request_across_router_prefill_transfer_and_decode(traced):
    cluster, receiver = traced
    rng = random.Random(1)
    request_ids = [f"trace-{i}" for i in range(4)]
    # 40 tokens: 3 blocks to pull, the last one partial. Sent at once, so the pods batch them.
    prompts = [[rng.randrange(3, 4096) for _ in range(40)] for _ in request_ids]
    with ThreadPoolExecutor(len(request_ids)) as pool:
        outputs = list(pool.map(lambda args: _generate(cluster.router.address, *args), zip(request_ids, prompts)))
    assert [len(tokens) for tokens in outputs] == [6] * len(request_ids)
    assert receiver.wait_for(lambda spans: all(_trace_complete(spans, rid) for rid in request_ids), timeout=20), (
        f"incomplete traces; received {sorted({(s.name, s.kind, s.service_name) for s in receiver.spans()})}"
    )
    spans = receiver.spans()
    by_trace = receiver.spans_by_trace()
    trace_ids = set()
    for request_id in request_ids:
        named = _request_spans(spans, request_id)
        # Exactly one trace per request: every span naming the request lives in it.
        assert len({span.trace_id for span in named}) == 1
        trace_ids.add(named[0].trace_id)
        _check_tree(by_trace[named[0].trace_id])
    assert len(trace_ids) == len(request_ids)
    # No request RPC or request stage leaked into a trace of its own.
    stray = [
        span for span in spans
        if span.trace_id not in trace_ids and span.name in {name for name, _, _ in EXPECTED} | {GET_KV_SOURCE}
    ]
    assert stray == []
    # The decode pod described the prefill engine before its first pull (then from its cache), inside
    # the request that needed it: under that request's Decode server span.
    fetches = [span for span in spans if span.name == GET_KV_SOURCE and span.kind == "CLIENT"]
    assert 1 <= len(fetches) <= len(request_ids)
    for fetch in fetches:
        assert fetch.trace_id in trace_ids and fetch.service_name == "pdserve-decode"
        trace = by_trace[fetch.trace_id]
        assert fetch.parent_span_id == _one(trace, DECODE, "SERVER").span_id
        server = _child(trace, fetch, GET_KV_SOURCE, "SERVER")
        assert server.service_name == "pdserve-prefill"


def _check_tree(trace: list[ReceivedSpan], root_name: str = GENERATE) -> ReceivedSpan:
    """The request's span tree under its root (the router's server span), which it returns."""
    root = _one(trace, root_name, "SERVER")
    span_ids = {span.span_id for span in trace}
    assert [span for span in trace if span.parent_span_id not in span_ids] == [root]
    assert root.attributes[SpanAttr.TTFT_S] > 0
    route_prefill = _child(trace, root, "route prefill")
    assert route_prefill.attributes["pdserve.worker"]
    _child(trace, root, "route decode")

    # router -> prefill pod
    prefill_client = _child(trace, root, PREFILL, "CLIENT")
    prefill = _child(trace, prefill_client, PREFILL, "SERVER")
    assert prefill.service_name == "pdserve-prefill"
    assert prefill.attributes[SpanAttr.NUM_PROMPT_TOKENS] == 40
    assert prefill.attributes[SpanAttr.TTFT_S] > 0
    queue = _child(trace, prefill, "prefill-queue")
    compute = _child(trace, prefill, "prefill")
    assert prefill.start_time_ns <= queue.start_time_ns <= queue.end_time_ns <= compute.start_time_ns
    assert compute.end_time_ns <= prefill.end_time_ns
    hold = _child(trace, prefill, "kv-hold")
    assert hold.attributes[SpanAttr.KV_OUTCOME] == "released"
    assert hold.attributes[SpanAttr.KV_BLOCKS] == 3
    # The hold outlives the Prefill call: it ends when the decode pod confirms its pull.
    assert hold.end_time_ns > prefill.end_time_ns

    # router -> decode pod
    decode_client = _child(trace, root, DECODE, "CLIENT")
    decode = _child(trace, decode_client, DECODE, "SERVER")
    # A request that finished is no error: the router takes the pod's status instead of cancelling.
    assert decode_client.status != "ERROR" and decode.status != "ERROR", (decode_client, decode)
    assert decode.service_name == "pdserve-decode"
    assert decode.attributes[SpanAttr.NUM_OUTPUT_TOKENS] == 5  # token 1 came from prefill
    assert decode.attributes[SpanAttr.FINISH_REASON] == "length"
    assert decode.attributes[SpanAttr.TPOT_S] > 0
    pull = _child(trace, decode, "kv-pull")
    assert pull.attributes[SpanAttr.KV_OUTCOME] == "pulled"
    assert pull.attributes[SpanAttr.KV_BYTES] > 0
    assert pull.attributes[SpanAttr.KV_BLOCKS] == 3
    assert pull.attributes[SpanAttr.KV_GBPS] > 0
    decode_queue = _child(trace, decode, "decode-queue")
    decode_compute = _child(trace, decode, "decode")
    assert decode_queue.end_time_ns <= pull.start_time_ns <= pull.end_time_ns <= decode_compute.start_time_ns
    assert decode_compute.attributes[SpanAttr.NUM_OUTPUT_TOKENS] == 5

    # decode pod -> prefill pod: the pull's confirmation, and the hold ends with it
    release_client = _child(trace, pull, RELEASE_KV, "CLIENT")
    release = _child(trace, release_client, RELEASE_KV, "SERVER")
    assert release.service_name == "pdserve-prefill" and release.attributes["pdserve.kv.intact"] is True
    assert release.start_time_ns <= hold.end_time_ns <= release.end_time_ns
    return root


def test_one_http_request_is_one_trace_holding_the_http_span_and_the_pods_spans(traced):
    cluster, receiver = traced
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 4096) for _ in range(40)] for _ in range(2)]
    with openai.OpenAI(base_url=cluster.router.http_url, api_key="unused", max_retries=0) as client:
        # The router runs without a tokenizer: its model name is "pdserve", prompts are token ids.
        whole = client.completions.create(
            model="pdserve", prompt=prompts[0], max_tokens=6, extra_body={"ignore_eos": True, "request_id": "http-0"},
            extra_headers={"traceparent": f"00-{trace_id}-{CLIENT_SPAN_ID}-01"})
        streamed = list(client.completions.create(
            model="pdserve", prompt=prompts[1], max_tokens=6, stream=True,
            extra_body={"ignore_eos": True, "request_id": "http-1"}))
    assert whole.usage.completion_tokens == 6 and streamed[-1].choices[0].finish_reason == "length"
    request_ids = ["http-0", "http-1"]
    assert receiver.wait_for(
        lambda spans: all(_trace_complete(spans, rid, HTTP_COMPLETIONS) for rid in request_ids), timeout=20
    ), f"incomplete traces; received {sorted({(s.name, s.kind, s.service_name) for s in receiver.spans()})}"
    spans = receiver.spans()
    by_trace = receiver.spans_by_trace()
    roots = {}
    for request_id in request_ids:
        named = _request_spans(spans, request_id)
        assert len({span.trace_id for span in named}) == 1  # router, prefill and decode spans: one trace
        trace = by_trace[named[0].trace_id]
        roots[request_id] = root = _check_tree(trace, HTTP_COMPLETIONS)
        assert root.service_name == "pdserve-router"
        assert root.attributes["http.request.method"] == "POST"
        assert root.attributes["http.route"] == "/v1/completions"
        assert root.attributes["http.response.status_code"] == 200
        # Generate ran in process: no gRPC server span of its own.
        assert not [span for span in trace if span.name == GENERATE]
        # The span lasts until the response's last byte (a stream's too): past the decode pod's compute.
        assert root.end_time_ns >= _one(trace, "decode", "INTERNAL").end_time_ns
    # The client's traceparent made the first request part of the client's trace.
    assert roots["http-0"].trace_id == trace_id and roots["http-0"].parent_span_id == CLIENT_SPAN_ID
    assert roots["http-1"].parent_span_id is None and roots["http-1"].trace_id != trace_id


def test_a_clients_traceparent_is_honoured(traced):
    cluster, receiver = traced
    traceparent = f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"
    prompt = [random.Random(2).randrange(3, 4096) for _ in range(20)]
    _generate(cluster.router.address, "client-trace", prompt, metadata=(("traceparent", traceparent),))
    assert receiver.wait_for(lambda spans: _trace_complete(spans, "client-trace"), timeout=20)
    named = _request_spans(receiver.spans(), "client-trace")
    assert {span.trace_id for span in named} == {CLIENT_TRACE_ID}
    root = _one(receiver.spans_by_trace()[CLIENT_TRACE_ID], GENERATE, "SERVER")
    assert root.parent_span_id == CLIENT_SPAN_ID


def test_an_expired_hold_ends_its_span_at_the_lease_deadline(traced):
    cluster, receiver = traced
    trace_id = "5b8efff798038103d269b633813fc60c"
    metadata = (("traceparent", f"00-{trace_id}-{CLIENT_SPAN_ID}-01"),)
    prompt = [random.Random(3).randrange(3, 4096) for _ in range(50)]
    request = prefill_request_to_proto("expiring", prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    with grpc.insecure_channel(cluster.by_name("prefill-0").address) as channel:
        answer = prefill_pb2_grpc.PrefillServiceStub(channel).Prefill(request, timeout=30, metadata=metadata)
    assert len(answer.handle.block_ids) == 4  # nobody pulls them
    assert receiver.wait_for(
        lambda spans: any(s.name == "kv-hold" and s.trace_id == trace_id for s in spans), timeout=LEASE_S + 10
    )
    trace = receiver.spans_by_trace()[trace_id]
    prefill = _one(trace, PREFILL, "SERVER")
    assert prefill.parent_span_id == CLIENT_SPAN_ID
    hold = _child(trace, prefill, "kv-hold")
    assert hold.attributes[SpanAttr.KV_OUTCOME] == "expired"
    assert hold.attributes[SpanAttr.KV_BLOCKS] == 4
    assert hold.end_time_ns == answer.handle.lease_deadline_unix_ms * 1_000_000
    assert (hold.end_time_ns - hold.start_time_ns) / 1e9 == pytest.approx(LEASE_S, abs=0.01)

"""The image job's client side (scripts/image_pods.py runs it with `ip netns exec` in a client or node
namespace): one request, concurrent long streams, a probe watch, /metrics. Prints JSON lines only.
    request ROUTER_IP MAX_TOKENS                 one HTTP completion and one gRPC Generate
    streams ROUTER_IP N_HTTP N_GRPC MAX_TOKENS   long streams; a {"started": ...} line once each has tokens
    health ADDR SERVICE                          one gRPC health check (what kubelet's grpc probe asks)
    watch ADDR                                   readiness ("") and liveness every 0.25 s until the port closes
    metrics URL                                  the Prometheus text of a /metrics endpoint
"""
from __future__ import annotations

import json
import sys
import threading
import time

import grpc
import openai
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.client import PdserveClient

PROMPT_TOKENS = 64  # four 16-token blocks for decode to pull


def prompt(index: int) -> list[int]:
    """A prompt of its own per request: a prefix another request left in decode's cache is not pulled."""
    return [10 + (index * 7 + i) % 200 for i in range(PROMPT_TOKENS)]
GRPC_PORT, HTTP_PORT = 50051, 8000


def _say(**fields) -> None:
    print(json.dumps(fields), flush=True)


def http_stream(router_ip: str, max_tokens: int, index: int, on_token=lambda: None) -> dict:
    """One streamed completion through the official client: tokens, and how it ended (finish_reason,
    an SSE error event, or cut: the connection closed with neither)."""
    client = openai.OpenAI(base_url=f"http://{router_ip}:{HTTP_PORT}/v1", api_key="none", max_retries=0,
                           timeout=120)
    started, tokens, num_chunks, finish, error = time.monotonic(), None, 0, None, None
    try:
        stream = client.completions.create(model="tiny", prompt=prompt(index), max_tokens=max_tokens, temperature=0,
                                           stream=True, stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True})
        for chunk in stream:
            for choice in chunk.choices:
                num_chunks += 1
                on_token()
                finish = choice.finish_reason or finish
            if chunk.usage is not None:  # the last chunk: a chunk's text may hold several tokens, or none
                tokens = chunk.usage.completion_tokens
    except openai.APIConnectionError as exc:  # the connection closed under the stream
        error = f"cut: {type(exc).__name__}: {exc.__cause__ or exc}"
    except openai.APIStatusError as exc:
        error = f"error status {exc.status_code}: {exc.message}"
    except openai.APIError as exc:  # the client raises an SSE error event as this
        error = f"error event: {exc.message}"
    if error is None and finish is None:
        error = "cut: the stream ended with no finish_reason, no error event"
    tokens = num_chunks if tokens is None else tokens  # a cut stream sends no usage: count its chunks
    return {"front": "http", "tokens": tokens, "finish": finish, "error": error,
            "seconds": round(time.monotonic() - started, 2), "ended_at": time.time()}


def grpc_stream(router_ip: str, max_tokens: int, index: int, on_token=lambda: None) -> dict:
    started, tokens, finish, error = time.monotonic(), 0, None, None
    try:
        with PdserveClient(f"{router_ip}:{GRPC_PORT}") as client:
            for chunk in client.generate(prompt(index), max_tokens=max_tokens, ignore_eos=True, timeout=120):
                for _ in chunk.token_ids:
                    tokens += 1
                    on_token()
                if chunk.finish_reason is not None:
                    finish = chunk.finish_reason.value
    except grpc.RpcError as exc:
        error = f"status {exc.code().name}: {exc.details()}"
    if error is None and finish is None:
        error = "cut: the stream ended with no finish_reason"
    return {"front": "grpc", "tokens": tokens, "finish": finish, "error": error,
            "seconds": round(time.monotonic() - started, 2), "ended_at": time.time()}


def request(router_ip: str, max_tokens: int) -> None:
    client = openai.OpenAI(base_url=f"http://{router_ip}:{HTTP_PORT}/v1", api_key="none", max_retries=0,
                           timeout=60)
    started = time.monotonic()
    answer = client.completions.create(model="tiny", prompt=prompt(0), max_tokens=max_tokens, temperature=0,
                                       extra_body={"ignore_eos": True})
    _say(front="http", endpoint="POST /v1/completions", tokens=answer.usage.completion_tokens,
         finish=answer.choices[0].finish_reason, seconds=round(time.monotonic() - started, 2))
    result = grpc_stream(router_ip, max_tokens, 1)
    _say(**result, endpoint="GenerateService/Generate")


def streams(router_ip: str, num_http: int, num_grpc: int, max_tokens: int) -> None:
    """Runs the streams together; says "started" once every one has its first token, then each result."""
    total = num_http + num_grpc
    first_tokens: set[int] = set()
    lock = threading.Lock()
    results: list[dict] = []

    def run(index: int, stream) -> None:
        def on_token() -> None:
            with lock:
                if index not in first_tokens:
                    first_tokens.add(index)
                    if len(first_tokens) == total:
                        _say(started=total)
        result = stream(router_ip, max_tokens, 100 + index, on_token)
        with lock:
            results.append(result)

    kinds = [http_stream] * num_http + [grpc_stream] * num_grpc
    threads = [threading.Thread(target=run, args=(i, kind)) for i, kind in enumerate(kinds)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    _say(results=results)


def health(address: str, service: str, timeout_s: float = 2.0) -> str:
    try:
        with grpc.insecure_channel(address) as channel:
            answer = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)
    except grpc.RpcError as exc:
        return f"{exc.code().name}"


def watch(address: str) -> None:
    """Readiness and liveness as kubelet would see them, one line per change, until the server is gone."""
    last = None
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            states = []
            for service in ("", "liveness"):
                try:
                    answer = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1)
                    states.append(health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status))
                except grpc.RpcError as exc:
                    states.append(exc.code().name)
            if states != last:
                _say(at=time.time(), readiness=states[0], liveness=states[1])
                last = states
            if states[1] == "UNAVAILABLE":
                return
            time.sleep(0.25)


def metrics(url: str) -> None:
    import urllib.request

    with urllib.request.urlopen(url, timeout=5) as answer:
        _say(text=answer.read().decode())


def main(argv: list[str]) -> None:
    command, *rest = argv
    if command == "request":
        request(rest[0], int(rest[1]))
    elif command == "streams":
        streams(rest[0], int(rest[1]), int(rest[2]), int(rest[3]))
    elif command == "health":
        _say(status=health(rest[0], rest[1]))
    elif command == "watch":
        watch(rest[0])
    elif command == "metrics":
        metrics(rest[0])
    else:
        sys.exit(f"unknown command {command!r}")


if __name__ == "__main__":
    main(sys.argv[1:])

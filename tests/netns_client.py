"""Runs inside a test's network namespace (tests/test_netns.py) and prints one JSON line:
    generate ADDR MAX_TOKENS     stream a completion, report tokens and finish reason
    health ADDR SERVICE          the gRPC health status of SERVICE ("" = overall)
    metrics URL                  the Prometheus text of a /metrics endpoint
"""
from __future__ import annotations

import json
import sys
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.client import PdserveClient

PROMPT = list(range(10, 74))  # 64 tokens: four 16-token blocks to pull


def generate(address: str, max_tokens: int) -> dict:
    num_tokens, finish_reason = 0, None
    with PdserveClient(address) as client:
        for chunk in client.generate(PROMPT, max_tokens=max_tokens, ignore_eos=True):
            num_tokens += len(chunk.token_ids)
            if chunk.finish_reason is not None:
                finish_reason = chunk.finish_reason.value
    return {"num_tokens": num_tokens, "finish_reason": finish_reason}


def health(address: str, service: str) -> dict:
    with grpc.insecure_channel(address) as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return {"status": health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)}


def metrics(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as answer:
        return {"text": answer.read().decode()}


if __name__ == "__main__":
    command, *rest = sys.argv[1:]
    if command == "generate":
        print(json.dumps(generate(rest[0], int(rest[1]))))
    elif command == "health":
        print(json.dumps(health(rest[0], rest[1] if len(rest) > 1 else "")))
    elif command == "metrics":
        print(json.dumps(metrics(rest[0])))
    else:
        sys.exit(f"unknown command {command!r}")

"""The three-process split system the e2e tests share (router + one prefill + one decode pod on
127.0.0.1), started once per test session by the `split_cluster` fixture in conftest.py."""
from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest

from pdserve.launcher import LocalCluster
from proto.pdserve.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc

BLOCK_SIZE = 16
NUM_BLOCKS = 512
LEASE_S = 3.0
MODEL_ARGS = ["--model", "tiny", "--seed", "0", "--block-size", str(BLOCK_SIZE), "--num-blocks", str(NUM_BLOCKS)]
# tiny: hidden 256, 4 layers, 4 KV heads of 32 dims, float32 -> K and V of one block, all layers.
BYTES_PER_BLOCK = 4 * 2 * BLOCK_SIZE * 4 * 32 * 4
VOCAB_SIZE = 4096  # of the tiny preset


def start_split_cluster(log_dir: Path) -> LocalCluster:
    return LocalCluster.start(
        pod_args=MODEL_ARGS, prefill_args=["--lease-s", str(LEASE_S)],
        router_args=["--tokenizer", "tiny", "--tool-call-parser", "hermes"],
        with_metrics=True, log_dir=log_dir,
    )


def load_report(address: str, stub_type) -> common_pb2.LoadReport:
    with grpc.insecure_channel(address) as channel:
        return stub_type(channel).GetLoad(common_pb2.GetLoadRequest(), timeout=5).load


def assert_all_blocks_free(cluster: LocalCluster, timeout_s: float = 10.0) -> None:
    """Fails unless prefill-0 and decode-0 have every block free and none held within timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        prefill = load_report(cluster.by_name("prefill-0").address, prefill_pb2_grpc.PrefillServiceStub)
        decode = load_report(cluster.by_name("decode-0").address, decode_pb2_grpc.DecodeServiceStub)
        loads = (prefill, decode)
        if all(load.num_free_blocks == load.num_total_blocks and load.num_held_blocks == 0 for load in loads):
            return
        if time.monotonic() > deadline:
            pytest.fail(f"blocks still in use: prefill {prefill}, decode {decode}")
        time.sleep(0.1)


def greedy_all(address: str, prompts: list[list[int]], num_output: int) -> list[list[int]]:
    """Every prompt sent at once to the Generate API at address (the pods batch them): num_output greedy
    tokens each (ignore_eos), in prompt order."""
    from concurrent.futures import ThreadPoolExecutor

    from pdserve.client import PdserveClient

    def one(prompt: list[int]) -> list[int]:
        tokens = []
        with PdserveClient(address) as client:
            for chunk in client.generate(prompt, max_tokens=num_output, temperature=0.0, ignore_eos=True,
                                         timeout=600):
                tokens += chunk.token_ids
        return tokens

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))

"""The three-process split system the e2e tests share (router + one prefill + one decode pod on
127.0.0.1), started once per test session by the `split_cluster` fixture in conftest.py."""
from __future__ import annotations

from pathlib import Path

from pdserve.launcher import LocalCluster

BLOCK_SIZE = 16
NUM_BLOCKS = 512
LEASE_S = 3.0
MODEL_ARGS = ["--model", "tiny", "--seed", "0", "--block-size", str(BLOCK_SIZE), "--num-blocks", str(NUM_BLOCKS)]
# tiny: hidden 256, 4 layers, 4 KV heads of 32 dims, float32 -> K and V of one block, all layers.
BYTES_PER_BLOCK = 4 * 2 * BLOCK_SIZE * 4 * 32 * 4
VOCAB_SIZE = 4096  # of the tiny preset


def start_split_cluster(log_dir: Path) -> LocalCluster:
    return LocalCluster.start(
        pod_args=MODEL_ARGS, prefill_args=["--lease-s", str(LEASE_S)], router_args=["--tokenizer", "tiny"],
        with_metrics=True, log_dir=log_dir,
    )

"""Random GGUF files (Llama, Qwen2, Qwen3, every supported tensor type in one file) served in float32 by the
split system (router, prefill, NIXL pull, decode) and by the colocated server give transformers' greedy
tokens on the same file, token for token, and the split system frees every block."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers needs it to load a GGUF

from gguf_files import write_gguf  # noqa: E402
from pdserve.launcher import HOST, LocalCluster, free_port, start_service, wait_serving  # noqa: E402
from split_cluster import assert_all_blocks_free, greedy_all  # noqa: E402
from test_gguf_checkpoints import CONFIGS, MIXED_TYPES, NUM_OUTPUT, PROMPTS, _transformers_load  # noqa: E402
from torch_threads import one_torch_thread  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


def _transformers_greedy(path) -> list[list[int]]:
    model = _transformers_load(path)
    with one_torch_thread(), torch.no_grad():
        return [model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               max_new_tokens=NUM_OUTPUT, min_new_tokens=NUM_OUTPUT, do_sample=False,
                               pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_split_and_colocated_equal_transformers_on_a_gguf_file(tmp_path, arch):
    path = write_gguf(tmp_path / f"{arch}-mixed.gguf", CONFIGS[arch], MIXED_TYPES)
    expected = _transformers_greedy(path)
    pod_args = ["--model", str(path), "--dtype", "float32", "--num-blocks", "64", "--max-model-len", "256",
                "--num-threads", "1"]
    port = free_port()
    colocated = start_service("colocated", "colocated_svc", ["--host", HOST, "--port", str(port), *pod_args],
                              address=f"{HOST}:{port}", log_dir=tmp_path)
    try:
        with LocalCluster.start(pod_args=pod_args, log_dir=tmp_path, timeout_s=300) as cluster:
            assert greedy_all(cluster.router.address, PROMPTS, NUM_OUTPUT) == expected
            assert_all_blocks_free(cluster)
            wait_serving(colocated, timeout_s=300)
            assert greedy_all(colocated.address, PROMPTS, NUM_OUTPUT) == expected
    finally:
        colocated.stop()

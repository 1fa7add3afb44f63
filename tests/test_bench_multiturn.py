"""`pdserve bench multi-turn`: the seeded conversation script, and a run against a colocated server whose
later turns find their history in the prefix cache."""
from __future__ import annotations

import json

import pytest

from pdserve import bench
from pdserve.bench_multiturn import MultiTurnConfig, write_script


def test_the_script_is_seeded_and_shaped_by_the_config():
    config = MultiTurnConfig(num_conversations=3, num_turns=4, system_prompt_len=20, user_len=5, think_time_s=0.2)
    script = write_script(config)
    assert script == write_script(config)
    assert script != write_script(MultiTurnConfig(num_conversations=3, num_turns=4, system_prompt_len=20,
                                                  user_len=5, think_time_s=0.2, seed=1))
    assert len(script.system_prompt) == 20
    assert [[len(m) for m in turns] for turns in script.user_messages] == [[5] * 4] * 3
    assert all(t[0] == 0.0 and len(t) == 4 and min(t) >= 0 for t in script.think_times_s)
    assert all(3 <= token < config.vocab_size for token in script.system_prompt)


@pytest.mark.parametrize("field, value", [("num_turns", 0), ("user_len", 0), ("think_time_s", -1.0)])
def test_bad_configs_are_refused(field, value):
    with pytest.raises(ValueError, match=field if field != "think_time_s" else "think_time_s"):
        MultiTurnConfig(**{field: value})


@pytest.fixture(scope="module")
def colocated_server(tmp_path_factory):
    from pdserve.launcher import HOST, free_port, start_service, wait_serving

    port, metrics_port = free_port(), free_port()
    service = start_service(
        "colocated", "colocated_svc",
        ["--host", HOST, "--port", str(port), "--metrics-port", str(metrics_port), "--model", "tiny",
         "--block-size", "16", "--num-blocks", "256"],
        address=f"{HOST}:{port}", log_dir=tmp_path_factory.mktemp("logs"), env={"OMP_NUM_THREADS": "1"},
    )
    service.metrics_url = f"http://{HOST}:{metrics_port}/metrics"
    try:
        wait_serving(service, timeout_s=90)
        yield service
    finally:
        service.stop()


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_later_turns_hit_the_prefix_cache(colocated_server, tmp_path, capsys):
    out = tmp_path / "report.json"
    argv = ["multi-turn", "--target", colocated_server.address, "--metrics-url", colocated_server.metrics_url,
            "--num-conversations", "2", "--num-turns", "3", "--system-prompt-len", "64", "--user-len", "16",
            "--output-len", "8", "--think-time-s", "0.05", "--out", str(out)]
    assert bench.main(argv) == 0
    report = json.loads(out.read_text())
    turns = report["turns"]
    assert [t["num_completed"] for t in turns] == [2, 2, 2] and report["num_failed"] == 0
    assert all(t["num_output_tokens"] == 16 for t in turns)
    # Turn 2 re-sends the system prompt, turn 1's message and its answer: 88 of 104 tokens, 80 of them
    # in whole cached blocks (the block holding the last known token is recomputed).
    assert turns[1]["prefix_hit_rate"] >= 0.6
    assert all(t["kv_bytes_pulled"] == 0 for t in turns)  # colocated: nothing moves
    assert report["ttft_ms_later_turns"]["p50"] > 0
    assert "| multi-turn | 3 | 2/0 |" in capsys.readouterr().out

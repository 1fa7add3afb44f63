"""The fault matrix's shared pieces: one restartable cluster per session, the greedy reference, and
the matrix table, printed at the end of the run and written to fault_matrix.txt in pytest's tmp dir."""
from __future__ import annotations

import pytest

from matrix import Row, format_table

_MATRIX_KEY = pytest.StashKey[list]()


@pytest.fixture(scope="session")
def fault_cluster(tmp_path_factory):
    from fault_cluster import FaultCluster  # the unit lane does not load the launcher

    cluster = FaultCluster.start(tmp_path_factory.mktemp("fault-cluster-logs"))
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def reference():
    """reference(prompt, max_tokens): the greedy output of the single-process engine, same weights."""
    from shared.engine.llm_engine import LLMEngine
    from shared.engine.request import SamplingParams
    from shared.engine.sched_config import CacheConfig, SchedulerConfig

    from fault_cluster import BLOCK_SIZE
    from matrix import LONG_PROMPTS, REFERENCE_TOKENS, SHORT_PROMPTS

    engine = LLMEngine("tiny", SchedulerConfig(max_model_len=2048), CacheConfig(block_size=BLOCK_SIZE, num_blocks=2048))
    prompts = SHORT_PROMPTS + LONG_PROMPTS
    outputs = engine.generate(prompts, SamplingParams(max_tokens=REFERENCE_TOKENS, ignore_eos=True))
    by_prompt = {tuple(p): out.token_ids for p, out in zip(prompts, outputs)}

    def lookup(prompt: list[int], max_tokens: int) -> list[int]:
        assert max_tokens <= REFERENCE_TOKENS
        return list(by_prompt[tuple(prompt)][:max_tokens])

    return lookup


@pytest.fixture(scope="session")
def fault_matrix(pytestconfig, tmp_path_factory):
    rows: list[Row] = []
    pytestconfig.stash[_MATRIX_KEY] = rows
    yield rows
    (tmp_path_factory.getbasetemp() / "fault_matrix.txt").write_text(format_table(rows) + "\n")


def pytest_terminal_summary(terminalreporter, config):
    rows = config.stash.get(_MATRIX_KEY, None)
    if rows:
        terminalreporter.write_sep("=", "fault matrix")
        terminalreporter.write_line(format_table(rows))

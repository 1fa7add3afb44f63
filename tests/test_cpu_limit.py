"""shared.serving.server.cpu_limit: torch's thread count follows the container's CPU quota (cgroup v2 and v1)."""
import os
from pathlib import Path

import pytest

from shared.serving.server.cpu_limit import cgroup_cpu_limit, default_num_threads
from shared.serving.pod.flags import parse_port_range


def test_cgroup_v2_quota(tmp_path: Path) -> None:
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_limit(tmp_path) == 1.5
    assert default_num_threads(tmp_path) == 1


def test_cgroup_v2_unlimited(tmp_path: Path) -> None:
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_limit(tmp_path) is None
    assert default_num_threads(tmp_path) is None


def test_cgroup_v1_quota_is_capped_by_the_cpus_we_may_run_on(tmp_path: Path) -> None:
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("6400000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_limit(tmp_path) == 64
    assert default_num_threads(tmp_path) == min(64, len(os.sched_getaffinity(0)))


def test_cgroup_v1_unlimited(tmp_path: Path) -> None:
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert default_num_threads(tmp_path) is None


def test_no_cgroup_files_means_no_limit(tmp_path: Path) -> None:
    assert cgroup_cpu_limit(tmp_path) is None


@pytest.mark.parametrize("value", ["20000-20099", "1024-1024"])
def test_port_range_accepts(value: str) -> None:
    assert parse_port_range(value) == value


@pytest.mark.parametrize("value", ["20000", "20099-20000", "80-90", "a-b", "20000-70000"])
def test_port_range_refuses(value: str) -> None:
    import argparse

    with pytest.raises(argparse.ArgumentTypeError, match="LOW-HIGH"):
        parse_port_range(value)

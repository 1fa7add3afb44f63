"""The CPU limit a container runs under (its cgroup CPU quota), which torch cannot see: it sizes its thread
pool from the node's cores, so a pod limited to 2 CPUs on a 64-core node would run 64 throttled threads."""
from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_cpu_limit(root: Path = CGROUP_ROOT) -> float | None:
    """CPUs allowed by the quota (cgroup v2 cpu.max, else v1 cpu.cfs_quota_us); None when unlimited."""
    v2 = root / "cpu.max"
    if v2.is_file():
        quota, period = v2.read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    for folder in (root / "cpu", root / "cpu,cpuacct"):
        quota_file, period_file = folder / "cpu.cfs_quota_us", folder / "cpu.cfs_period_us"
        if quota_file.is_file() and period_file.is_file():
            quota = int(quota_file.read_text())
            return None if quota < 0 else quota / int(period_file.read_text())
    return None


def default_num_threads(root: Path = CGROUP_ROOT) -> int | None:
    """Threads for torch when --num-threads is not given: the quota rounded down (at least 1), never more
    than the CPUs this process may run on; None without a quota (torch's own choice stands)."""
    limit = cgroup_cpu_limit(root)
    if limit is None:
        return None
    return max(1, min(math.floor(limit), len(os.sched_getaffinity(0))))

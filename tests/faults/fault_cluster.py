"""The fault matrix's system: router + two prefill + two decode pods, each an OS process on 127.0.0.1
that a scenario may kill, freeze, drain and restart on the same ports; the pods' Prometheus gauges;
and the greedy reference outputs the scenarios' outputs must match."""
from __future__ import annotations

import os
import signal
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.launcher import HOST, ServiceProcess, free_port, new_cluster_env, start_service, wait_serving

BLOCK_SIZE = 16
NUM_BLOCKS = 320
LEASE_S = 3.0
STALL_TIMEOUT_S = 2.0
MODEL_ARGS = ["--model", "tiny", "--seed", "0", "--block-size", str(BLOCK_SIZE), "--num-blocks", str(NUM_BLOCKS),
              "--max-model-len", "2048", "--num-threads", "1"]
ROUTER_ARGS = ["--stall-timeout", str(STALL_TIMEOUT_S), "--health-interval", "0.2",
               "--decode-admit-timeout", "10"]
PREFILL = ("prefill-0", "prefill-1")
DECODE = ("decode-0", "decode-1")
PODS = PREFILL + DECODE


@dataclass
class Member:
    """One service: how to start it again on the same ports, and the process running now."""

    name: str
    module: str
    args: list[str]
    address: str
    metrics_url: str | None
    process: ServiceProcess | None = None
    num_starts: int = 0
    is_ready: bool = False  # SERVING since its last start


@dataclass
class FaultCluster:
    log_dir: Path
    members: dict[str, Member] = field(default_factory=dict)
    # One KV-handle key for the whole cluster, restarts included: a restarted pod must keep verifying
    # (and signing) handles the others accept.
    env: dict[str, str] = field(default_factory=new_cluster_env)

    @classmethod
    def start(cls, log_dir: Path) -> "FaultCluster":
        cluster = cls(log_dir)
        try:
            for name in PREFILL:
                cluster._add(name, "prefill_svc", [*MODEL_ARGS, "--lease-s", str(LEASE_S)])
            for name in DECODE:
                cluster._add(name, "decode_svc", MODEL_ARGS)
            routing = [f"--prefill={','.join(cluster.address(n) for n in PREFILL)}",
                       f"--decode={','.join(cluster.address(n) for n in DECODE)}"]
            cluster._add("router", "router", [*routing, *ROUTER_ARGS])
            for name in cluster.members:
                cluster._launch(name)
            cluster.wait_ready(tuple(cluster.members))
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _add(self, name: str, module: str, args: list[str]) -> None:
        port, metrics_port = free_port(), free_port()
        address = f"{HOST}:{port}"
        args = ["--host", HOST, "--port", str(port), "--metrics-port", str(metrics_port), *args]
        self.members[name] = Member(name, module, args, address, f"http://{HOST}:{metrics_port}/metrics")

    def _launch(self, name: str) -> None:
        member = self.members[name]
        member.num_starts += 1
        member.is_ready = False
        log_name = name if member.num_starts == 1 else f"{name}.{member.num_starts}"
        member.process = start_service(log_name, member.module, member.args, address=member.address,
                                       log_dir=self.log_dir, env=self.env)

    def address(self, name: str) -> str:
        return self.members[name].address

    @property
    def router_address(self) -> str:
        return self.address("router")

    # ---- faults ------------------------------------------------------------------------------
    def send(self, name: str, sig: signal.Signals) -> None:
        os.kill(self.members[name].process.pid, sig)

    def restart(self, name: str, *, timeout_s: float = 30.0) -> None:
        """Waits for the process to end (SIGKILL after timeout_s), then starts it again on its ports
        without waiting for it: wait_ready() does, when a scenario needs it."""
        process = self.members[name].process.process
        try:
            process.wait(timeout_s)
        except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired: it did not drain in time
            process.kill()
            process.wait(10)
        self._launch(name)

    def wait_ready(self, names: tuple[str, ...]) -> None:
        for name in names:
            member = self.members[name]
            if not member.is_ready:
                wait_serving(member.process)
                member.is_ready = True

    def ensure_running(self, names: tuple[str, ...]) -> None:
        """The named services are up and SERVING, the others at least started and not frozen (a
        scenario that failed half-way may have left one down or stopped)."""
        for name, member in self.members.items():
            if not member.process.is_running():
                self._launch(name)
            else:
                self.send(name, signal.SIGCONT)
        self.wait_ready(names)

    # ---- metrics -----------------------------------------------------------------------------
    def gauges(self, name: str) -> dict[str, float]:
        """The pod's unlabelled pdserve_* samples (counters and gauges)."""
        with urllib.request.urlopen(self.members[name].metrics_url, timeout=5) as answer:
            text = answer.read().decode()
        values = {}
        for line in text.splitlines():
            if line.startswith("pdserve_") and "{" not in line:
                key, _, value = line.partition(" ")
                values[key] = float(value)
        return values

    def counter(self, name: str, metric: str, **labels: str) -> float:
        """One labelled sample of the service's metrics (0 when absent)."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(self.members[name].metrics_url, timeout=5) as answer:
            text = answer.read().decode()
        return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
                   if sample.name == metric and all(sample.labels.get(k) == v for k, v in labels.items()))

    def blocks_in_use(self) -> dict[str, int]:
        """Per pod: KV blocks used plus blocks held for a peer (both 0 when nothing leaked)."""
        out = {}
        for name in PODS:
            if not self.members[name].is_ready:
                continue  # restarting: a fresh process holds nothing yet
            values = self.gauges(name)
            out[name] = int(values["pdserve_kv_blocks_used"] + values["pdserve_kv_blocks_held_for_peer"])
        return out

    def wait_blocks_free(self, timeout_s: float) -> dict[str, int]:
        """Polls the pods' gauges until every block is free or timeout_s passes; the last reading."""
        deadline = time.monotonic() + timeout_s
        while True:
            in_use = self.blocks_in_use()
            if not any(in_use.values()) or time.monotonic() >= deadline:
                return in_use
            time.sleep(0.05)

    def stop(self) -> None:
        for member in reversed(list(self.members.values())):
            if member.process is not None:
                if member.process.is_running():
                    os.kill(member.process.pid, signal.SIGCONT)
                member.process.stop()

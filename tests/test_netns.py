"""Router, prefill and decode as on separate hosts: three network namespaces joined by veth pairs to a bridge
in a fourth, each with its own private address. Shows the KV pulled across namespaces (also behind a packet
filter that allows only the declared ports), a loud, counted failure when the KV port range is blocked,
router liveness apart from readiness, and a SIGTERM drain that lets a long stream finish. Needs root,
`ip netns` (and nft for the packet filters); skipped with the reason otherwise."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from pdserve.launcher import new_cluster_env

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import netns_bridge  # noqa: E402  (scripts/ is not a package)
SUBNET = "10.213.7"  # private, and only ever assigned inside the namespaces created here
ADDRESSES = {"router": f"{SUBNET}.1", "prefill": f"{SUBNET}.2", "decode": f"{SUBNET}.3"}
GRPC_PORTS = {"router": 50051, "prefill": 50061, "decode": 50071}
METRICS_PORT = 9400
KV_PORTS = (20000, 20009)
POD_ARGS = ["--model", "tiny", "--num-blocks", "256", "--max-model-len", "1024", "--num-threads", "1",
            "--metrics-port", str(METRICS_PORT), "--kv-port-range", f"{KV_PORTS[0]}-{KV_PORTS[1]}"]

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def _why_not_runnable() -> str | None:
    if os.geteuid() != 0:
        return "network-namespace tests need root (CI runs as root)"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    name = f"pdchk-{uuid.uuid4().hex[:6]}"
    created = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if created.returncode != 0:
        return f"`ip netns add` failed: {created.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


_REASON = _why_not_runnable()
if _REASON is not None:
    pytest.skip(_REASON, allow_module_level=True)

needs_nft = pytest.mark.skipif(shutil.which("nft") is None,
                               reason="the `nft` command (nftables) is not installed: `apt-get install nftables`")


class Lab:
    """The namespaces, their links, and the services running in them; close() removes everything."""

    def __init__(self, root: Path):
        suffix = uuid.uuid4().hex[:6]
        self.root = root
        self.hub = f"pdhub-{suffix}"
        self.namespaces = {tier: f"pd{tier[0]}-{suffix}" for tier in ADDRESSES}
        self.processes: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}
        self._created: list[str] = []
        self._num_starts = 0
        self.env = new_cluster_env()  # the KV handle key the pods of this system share
        try:
            self._build(suffix)
        except BaseException:
            self.close()
            raise

    def _build(self, suffix: str) -> None:
        hosts = {tier: (namespace, ADDRESSES[tier]) for tier, namespace in self.namespaces.items()}
        netns_bridge.make_bridge(self.hub, hosts, suffix, self._created)

    def close(self) -> None:
        for tier in list(self.processes):
            self.stop(tier, kill=True)
        netns_bridge.remove_namespaces(self._created)

    # ---- services ----------------------------------------------------------------------------
    def start(self, tier: str, *extra: str) -> None:
        address, port = ADDRESSES[tier], GRPC_PORTS[tier]
        if tier == "router":
            args = ["router", "--prefill", f"{ADDRESSES['prefill']}:{GRPC_PORTS['prefill']}",
                    "--decode", f"{ADDRESSES['decode']}:{GRPC_PORTS['decode']}", "--health-interval", "0.3"]
        else:
            args = [tier, *POD_ARGS]
            if tier == "prefill":
                args += ["--advertise-address", f"{address}:{port}"]
        args += ["--host", address, "--port", str(port), *extra]
        self._num_starts += 1
        log = self.root / f"{self._num_starts:02d}-{tier}.log"
        self.logs[tier] = log
        env = {**os.environ, **self.env, "PYTHONPATH": str(REPO), "UCX_TLS": "tcp,self,sm"}
        with open(log, "w") as handle:
            self.processes[tier] = subprocess.Popen(
                ["ip", "netns", "exec", self.namespaces[tier], sys.executable, "-m", "pdserve.cli", *args],
                stdout=handle, stderr=subprocess.STDOUT, env=env, cwd=self.root,
            )
        self.wait_for_log(tier, f"{tier} listening on", timeout_s=90)

    def stop(self, tier: str, *, kill: bool = False, timeout_s: float = 30) -> int | None:
        process = self.processes.pop(tier, None)
        if process is None:
            return None
        process.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            return process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            return process.wait()

    def log(self, tier: str) -> str:
        return self.logs[tier].read_text()

    def wait_for_log(self, tier: str, text: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in self.log(tier):
            process = self.processes.get(tier)
            if process is not None and process.poll() is not None:
                pytest.fail(f"{tier} exited with {process.returncode}:\n{self.log(tier)[-4000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"{tier} did not log {text!r} in {timeout_s} s:\n{self.log(tier)[-4000:]}")
            time.sleep(0.1)

    # ---- clients and filters -----------------------------------------------------------------
    def client(self, *args: str, timeout_s: float = 60) -> dict:
        """Runs tests/netns_client.py in the router's namespace (where a client would be)."""
        result = subprocess.run(
            ["ip", "netns", "exec", self.namespaces["router"], sys.executable, str(REPO / "tests" / "netns_client.py"),
             *args],
            capture_output=True, text=True, timeout=timeout_s, env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        assert result.returncode == 0, result.stderr[-3000:]
        return json.loads(result.stdout.strip().splitlines()[-1])

    def client_popen(self, *args: str) -> subprocess.Popen:
        return subprocess.Popen(
            ["ip", "netns", "exec", self.namespaces["router"], sys.executable, str(REPO / "tests" / "netns_client.py"),
             *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)},
        )

    def generate(self, max_tokens: int) -> dict:
        return self.client("generate", f"{ADDRESSES['router']}:{GRPC_PORTS['router']}", str(max_tokens))

    def health(self, tier: str, service: str) -> str:
        return self.client("health", f"{ADDRESSES[tier]}:{GRPC_PORTS[tier]}", service)["status"]

    def metric(self, tier: str, name: str, **labels: str) -> float:
        text = self.client("metrics", f"http://{ADDRESSES[tier]}:{METRICS_PORT}/metrics")["text"]
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name) and all(f'{key}="{value}"' in line for key, value in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def filter_prefill(self, allowed_ports: list[str]) -> None:
        """Prefill's inbound traffic: replies and the listed TCP ports only (what a NetworkPolicy allows)."""
        rules = (
            "table inet pdserve {\n chain input {\n type filter hook input priority 0; policy drop;\n"
            " iif lo accept\n ct state established,related accept\n"
            f" tcp dport {{ {', '.join(allowed_ports)} }} accept\n }}\n}}\n"
        )
        namespace = self.namespaces["prefill"]
        subprocess.run(["ip", "netns", "exec", namespace, "nft", "delete", "table", "inet", "pdserve"],
                       capture_output=True)
        result = subprocess.run(["ip", "netns", "exec", namespace, "nft", "-f", "-"], input=rules,
                                capture_output=True, text=True, timeout=30)
        assert result.returncode == 0, f"nft refused the rules: {result.stderr}"


DECLARED_PORTS = [str(GRPC_PORTS["prefill"]), str(METRICS_PORT), f"{KV_PORTS[0]}-{KV_PORTS[1]}"]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    lab = Lab(tmp_path_factory.mktemp("netns"))
    try:
        lab.start("prefill")
        lab.start("decode")
        lab.start("router")
        yield lab
    finally:
        lab.close()


def _wait_ready(lab: Lab, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while lab.health("router", "") != "SERVING":
        assert time.monotonic() < deadline, "the router never became ready"
        time.sleep(0.3)


def _restart_decode(lab: Lab, *extra: str) -> None:
    """A fresh decode pod meets the prefill engine anew: new UCX connections, a new probe READ."""
    lab.stop("decode")
    lab.start("decode", *extra)
    _wait_ready(lab)


def test_the_kv_is_pulled_across_namespaces(lab: Lab) -> None:
    _wait_ready(lab)
    assert lab.generate(8) == {"num_tokens": 8, "finish_reason": "length"}
    assert lab.metric("decode", "pdserve_kv_pulls_total", transport="tcp", outcome="pulled") >= 1
    assert lab.metric("decode", "pdserve_kv_transfer_bytes_total") > 0
    lab.wait_for_log("decode", "KV transport check passed", timeout_s=15)  # the probe runs beside requests
    assert "reads over UCX tcp" in lab.log("decode")


@needs_nft
def test_the_pull_works_behind_a_filter_that_allows_only_the_declared_ports(lab: Lab) -> None:
    lab.filter_prefill(DECLARED_PORTS)
    _restart_decode(lab)
    assert lab.generate(8)["num_tokens"] == 8
    assert lab.metric("decode", "pdserve_kv_pulls_total", transport="tcp", outcome="pulled") >= 1
    lab.wait_for_log("decode", "KV transport check passed", timeout_s=15)
    assert lab.metric("decode", "pdserve_kv_transport_failures_total") == 0


@needs_nft
def test_a_blocked_kv_port_range_is_loud_and_counted(lab: Lab) -> None:
    lab.filter_prefill([str(GRPC_PORTS["prefill"]), str(METRICS_PORT)])
    try:
        _restart_decode(lab)
        stream = lab.client_popen("generate", f"{ADDRESSES['router']}:{GRPC_PORTS['router']}", "4")
        lab.wait_for_log("decode", "KV transport check FAILED", timeout_s=30)
        stdout, stderr = stream.communicate(timeout=80)  # the check fails (5 s), then decode recomputes
        assert json.loads(stdout.strip().splitlines()[-1])["num_tokens"] == 4, stderr[-3000:]
        # Known broken: later requests are recomputed at once, not held for a pull's whole deadline.
        started = time.monotonic()
        assert lab.generate(4)["num_tokens"] == 4
        assert time.monotonic() - started < 10
        error_line = next(line for line in lab.log("decode").splitlines() if "KV transport check FAILED" in line)
        assert f"{ADDRESSES['prefill']}:{GRPC_PORTS['prefill']}" in error_line  # the peer
        assert f"{KV_PORTS[0]}-{KV_PORTS[1]}" in error_line  # the ports
        assert "UCX transport tcp" in error_line  # the transport tried
        assert lab.metric("decode", "pdserve_kv_transport_failures_total", transport="tcp") == 1
        assert lab.metric("decode", "pdserve_kv_pulls_total", outcome="pulled") == 0
        assert lab.metric("decode", "pdserve_kv_pulls_total", transport="tcp", outcome="recomputed_error") == 2
    finally:
        lab.filter_prefill(DECLARED_PORTS)


def test_router_liveness_stays_serving_while_the_decode_tier_is_down(lab: Lab) -> None:
    lab.stop("decode")
    try:
        deadline = time.monotonic() + 20
        while lab.health("router", "") != "NOT_SERVING":
            assert time.monotonic() < deadline, "readiness never followed the decode tier down"
            time.sleep(0.3)
        assert lab.health("router", "liveness") == "SERVING"
    finally:
        lab.start("decode")
        _wait_ready(lab)


def test_sigterm_drain_keeps_a_long_stream_alive_within_the_grace(lab: Lab) -> None:
    _restart_decode(lab, "--grace-seconds", "25")
    max_tokens = 600
    stream = lab.client_popen("generate", f"{ADDRESSES['router']}:{GRPC_PORTS['router']}", str(max_tokens))
    try:
        time.sleep(1.0)  # the stream is under way
        assert stream.poll() is None, "the stream ended before the drain began; make it longer"
        started = time.monotonic()
        decode = lab.processes.pop("decode")
        decode.send_signal(signal.SIGTERM)
        stdout, stderr = stream.communicate(timeout=60)
        assert stream.returncode == 0, stderr[-3000:]
        assert json.loads(stdout.strip().splitlines()[-1]) == {"num_tokens": max_tokens, "finish_reason": "length"}
        assert decode.wait(timeout=40) == 0
        assert time.monotonic() - started < 25 + 5  # one deadline, not grace twice over
    finally:
        if stream.poll() is None:
            stream.kill()
        lab.start("decode")

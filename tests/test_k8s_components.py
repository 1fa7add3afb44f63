"""k8s/components: every overlay gives prefill and decode pods the KV handle key from a Secret, and the
tls Component (added to the dev overlay here) renders, validates strictly, and turns on mTLS for every
pod: the TLS files from the Secret pdserve-tls, the flags the services' parsers accept, and probes that
speak TLS through `pdserve health`."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from test_k8s_manifests import KUBERNETES_VERSION, OVERLAYS, REPO, _kubectl

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

COMPONENTS = ("router", "prefill", "decode")
TLS_FLAGS = {
    "--tls-cert": "/etc/pdserve/tls/tls.crt", "--tls-key": "/etc/pdserve/tls/tls.key",
    "--tls-ca": "/etc/pdserve/tls/ca.crt", "--tls-server-name": "pdserve",
}


def _render_dir(directory: Path) -> list[dict]:
    result = subprocess.run([_kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def _containers(docs: list[dict]) -> dict[str, dict]:
    return {
        doc["metadata"]["name"].removeprefix("pdserve-"): doc["spec"]["template"]["spec"]["containers"][0]
        for doc in docs if doc["kind"] == "Deployment" and doc["metadata"]["name"].startswith("pdserve-")
    }


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_split_pods_get_the_handle_key_from_a_secret(overlay):
    containers = _containers(_render_dir(REPO / "k8s" / "overlays" / overlay))
    for name in ("prefill", "decode"):
        env = {item["name"]: item for item in containers[name]["env"]}
        secret = env["PDSERVE_KV_HANDLE_KEY"]["valueFrom"]["secretKeyRef"]
        assert secret == {"name": "pdserve-kv-handle-key", "key": "key"}
    assert "PDSERVE_KV_HANDLE_KEY" not in {item["name"] for item in containers["router"].get("env", [])}


@pytest.fixture(scope="module")
def tls_docs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tls-overlay")
    up = os.path.relpath(REPO, directory)
    (directory / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [f"{up}/k8s/overlays/dev"], "components": [f"{up}/k8s/components/tls"],
    }))
    return _render_dir(directory)


def test_tls_component_documents_validate_strictly(tls_docs):
    for doc in tls_docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("name", COMPONENTS)
def test_tls_component_gives_every_pod_its_files_flags_and_tls_probes(tls_docs, name):
    base_containers = _containers(_render_dir(REPO / "k8s" / "overlays" / "dev"))
    import importlib

    from pdserve.cli import _parser

    deployment = next(d for d in tls_docs if d["kind"] == "Deployment" and d["metadata"]["name"] == f"pdserve-{name}")
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == "pdserve-tls"
    assert {m["name"]: m["mountPath"] for m in container["volumeMounts"]}["tls"] == "/etc/pdserve/tls"
    args = container["args"]
    given = dict(arg.split("=", 1) for arg in args if arg.startswith("--tls-"))
    assert given == TLS_FLAGS
    module = {"router": "router.flags", "prefill": "prefill_svc.flags", "decode": "decode_svc.flags"}[name]
    parsed = importlib.import_module(module).build_arg_parser().parse_args(
        [a.replace("$(POD_IP)", "10.1.2.3") for a in args[1:]]
    )
    assert (parsed.tls_cert, parsed.tls_ca, parsed.tls_server_name) == (
        TLS_FLAGS["--tls-cert"], TLS_FLAGS["--tls-ca"], "pdserve"
    )
    port = {p["name"]: p["containerPort"] for p in container["ports"]}["grpc"]
    plain = base_containers[name]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert "grpc" not in container[probe]
        command = container[probe]["exec"]["command"]
        assert command[:2] == ["pdserve", "health"]
        probe_args = _parser().parse_args(command[1:])
        assert probe_args.target == f"127.0.0.1:{port}" and probe_args.tls_cert == TLS_FLAGS["--tls-cert"]
        # kubelet's 1 s default would cut short a health check over mTLS on a busy pod.
        assert container[probe]["timeoutSeconds"] > probe_args.timeout
        # The same health service the plain-text probe asks (readiness: the whole server; liveness: "liveness").
        assert probe_args.service == plain[probe]["grpc"].get("service", "")

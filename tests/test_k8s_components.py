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


# ---- components/planner: the planner as KEDA's external scaler ---------------------------------
# The ScaledObject fields the component uses, typed and required as in KEDA's CRD (keda.sh_scaledobjects,
# openAPIV3Schema); closed (additionalProperties false), so a misspelt field fails here.
SCALED_OBJECT_SCHEMA = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"}, "kind": {"const": "ScaledObject"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object", "required": ["scaleTargetRef", "triggers"], "additionalProperties": False,
            "properties": {
                "scaleTargetRef": {"type": "object", "required": ["name"], "additionalProperties": False,
                                   "properties": {"name": {"type": "string"}, "kind": {"type": "string"},
                                                  "apiVersion": {"type": "string"}}},
                **{name: {"type": "integer", "minimum": 0, "maximum": 2**31 - 1} for name in (
                    "minReplicaCount", "maxReplicaCount", "pollingInterval", "cooldownPeriod")},
                "triggers": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["type", "metadata"], "additionalProperties": False,
                    "properties": {"type": {"enum": ["external", "external-push"]}, "name": {"type": "string"},
                                   "metadata": {"type": "object", "additionalProperties": {"type": "string"},
                                                "required": ["scalerAddress", "tier"]}}}},
            },
        },
    },
}


@pytest.fixture(scope="module", params=("dev", "gpu", "jaeger"))
def planner_docs(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(f"planner-{request.param}")
    up = os.path.relpath(REPO, directory)
    base = _render_dir(REPO / "k8s" / "overlays" / request.param)
    namespace = next(d["metadata"]["namespace"] for d in base if d["kind"] == "Deployment")
    (directory / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "namespace": namespace,
        "resources": [f"{up}/k8s/overlays/{request.param}"], "components": [f"{up}/k8s/components/planner"],
    }))
    return _render_dir(directory)


def test_planner_component_documents_validate(planner_docs):
    import jsonschema

    for doc in planner_docs:
        if doc["kind"] == "ScaledObject":
            jsonschema.validate(doc, SCALED_OBJECT_SCHEMA)
        else:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    broken = next(d for d in planner_docs if d["kind"] == "ScaledObject")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**broken, "spec": {**broken["spec"], "minReplicaCont": 1}}, SCALED_OBJECT_SCHEMA)


def test_each_tier_scales_on_the_planners_external_scaler(planner_docs):
    from planner.flags import PlannerConfig, build_arg_parser

    scaled = {d["spec"]["scaleTargetRef"]["name"]: d for d in planner_docs if d["kind"] == "ScaledObject"}
    assert set(scaled) == {"pdserve-prefill", "pdserve-decode"}
    deployment = next(d for d in planner_docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "pdserve-planner")
    service = next(d for d in planner_docs if d["kind"] == "Service" and d["metadata"]["name"] == "pdserve-planner")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    config = PlannerConfig.from_args(build_arg_parser().parse_args(container["args"][1:]))
    assert container["args"][0] == "planner"
    grpc_port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc")
    assert grpc_port == config.port == {p["name"]: p["containerPort"] for p in container["ports"]}["grpc"]
    namespace = service["metadata"]["namespace"]
    for name, scaled_object in scaled.items():
        assert any(d["kind"] == "Deployment" and d["metadata"]["name"] == name for d in planner_docs)
        trigger = scaled_object["spec"]["triggers"][0]
        assert trigger["type"] == "external"
        # KEDA's operator dials from its own namespace: the full name of the planner's Service.
        assert trigger["metadata"]["scalerAddress"] == f"pdserve-planner.{namespace}.svc.cluster.local:{grpc_port}"
        tier = trigger["metadata"]["tier"]
        assert name == f"pdserve-{tier}"
        spec = scaled_object["spec"]
        assert spec["minReplicaCount"] == getattr(config.policy, f"min_{tier}")
        assert spec["maxReplicaCount"] == getattr(config.policy, f"max_{tier}")
    # The planner reads every pod's metrics port through the headless Services, and the routers' through its own.
    for target in (*config.prefill_metrics, *config.decode_metrics, *config.router_metrics):
        headless = next(d for d in planner_docs if d["kind"] == "Service" and d["metadata"]["name"] == target.host)
        assert target.is_dns and headless["spec"]["clusterIP"] == "None"
        assert target.port in [p["port"] for p in headless["spec"]["ports"]]


def test_keda_may_call_the_planner_and_the_planner_may_read_the_pods(planner_docs):
    policy = next(d for d in planner_docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == "pdserve-planner")
    ingress = policy["spec"]["ingress"][0]
    assert ingress["from"][0]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "keda"}
    assert [p["port"] for p in ingress["ports"]] == [50090]
    egress = policy["spec"]["egress"][0]
    assert egress["to"][0]["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "pdserve"}
    assert [p["port"] for p in egress["ports"]] == [9400]

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
    """Built-in kinds against Kubernetes' schema, the ScaledObjects against KEDA's CRD (tests/crd_schemas),
    both strictly."""
    import jsonschema

    from test_k8s_custom_resources import _validators

    scaled_object = _validators()[("keda.sh/v1alpha1", "ScaledObject")]
    for doc in planner_docs:
        if doc["kind"] == "ScaledObject":
            scaled_object.validate(doc)
        else:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    broken = next(d for d in planner_docs if d["kind"] == "ScaledObject")
    with pytest.raises(jsonschema.ValidationError):
        scaled_object.validate({**broken, "spec": {**broken["spec"], "minReplicaCont": 1}})


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


def _render_with(overlay: str, *components: str) -> list[dict]:
    from test_k8s_manifests import _render

    return list(_render(overlay, components))


def _config(docs: list[dict]) -> dict[str, str]:
    return next(d["data"] for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("pdserve-config"))


def test_rdma_on_the_gpu_overlay_keeps_the_cuda_transports():
    transports = set(_config(_render_with("gpu", "rdma"))["UCX_TLS"].split(","))
    assert {"rc", "tcp", "cuda_copy", "cuda_ipc"} <= transports
    assert {"rc", "tcp", "self", "sm"} <= set(_config(_render_with("dev", "rdma"))["UCX_TLS"].split(","))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_keda_queries_match_only_their_own_namespace(overlay):
    docs = _render_with(overlay, "keda")
    namespace = next(d["metadata"]["name"] for d in docs if d["kind"] == "Namespace")
    queries = [d["spec"]["triggers"][0]["metadata"]["query"] for d in docs if d["kind"] == "ScaledObject"]
    assert len(queries) == 2
    for query in queries:
        assert f'namespace="{namespace}"' in query, query


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_service_monitor_carries_the_label_kube_prometheus_stack_selects(overlay):
    monitor = next(d for d in _render_with(overlay, "service-monitor") if d["kind"] == "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_disruption_budget_lets_a_drain_take_a_whole_tier(overlay):
    docs = _render_with(overlay)
    replicas = {d["metadata"]["name"]: d["spec"]["replicas"] for d in docs if d["kind"] == "Deployment"}
    for budget in (d for d in docs if d["kind"] == "PodDisruptionBudget"):
        count = replicas[budget["metadata"]["name"]]
        spec = budget["spec"]
        allowed = spec["maxUnavailable"] if "maxUnavailable" in spec else count - spec["minAvailable"]
        assert allowed < count, f"{overlay}: {budget['metadata']['name']} lets {allowed} of {count} go"

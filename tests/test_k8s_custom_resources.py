"""k8s/ custom resources (InferencePool, HTTPRoute, PrometheusRule, ServiceMonitor, ScaledObject) validated
against their CRDs' openAPIV3Schema, written down in tests/crd_schemas/ from the upstream CRDs (each file
names its repository, tag and path; no PyPI package ships these CRDs' schemas), strictly: a field the CRD
does not declare is an error, as with `kubectl apply --validate=strict`. Also: every PromQL expression of
the alerts and the Grafana dashboard parses and names metrics pdserve exports; the new objects fit the
router, pods and volume they point at."""
from __future__ import annotations

import copy
import functools
import json
import re
from pathlib import Path

import jsonschema
import kubernetes_validate
import promql_parser
import pytest
import yaml

from test_k8s_manifests import KUBERNETES_VERSION, OVERLAYS, REPO, _render

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

SCHEMAS = REPO / "tests" / "crd_schemas"
EVERY_COMPONENT = ("keda", "service-monitor", "alerts", "grafana-dashboards", "inference-gateway", "model-volume")
DASHBOARD = REPO / "k8s" / "components" / "grafana-dashboards" / "pdserve.json"
# Grafana's variables, replaced by values of their kind before a dashboard expression is parsed.
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$namespace": "pdserve"}


def _strict(schema: dict) -> dict:
    """The schema with additionalProperties false wherever it lists properties and does not keep unknown
    fields (Kubernetes would otherwise prune an unknown field silently)."""
    schema = copy.deepcopy(schema)
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if ("properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return schema


@functools.lru_cache(maxsize=None)
def _validators() -> dict[tuple[str, str], jsonschema.Draft4Validator]:
    validators = {}
    for path in SCHEMAS.glob("*.json"):
        crd = json.loads(path.read_text())
        validators[(f"{crd['group']}/{crd['version']}", crd["kind"])] = jsonschema.Draft4Validator(
            _strict(crd["openAPIV3Schema"]))
    return validators


def _custom(docs) -> list[dict]:
    known = {kind for _, kind in _validators()}
    return [doc for doc in docs if doc["kind"] in known]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_custom_resource_validates_against_its_crd(overlay: str) -> None:
    docs = _render(overlay, EVERY_COMPONENT)
    custom = _custom(docs)
    assert {doc["kind"] for doc in custom} == {"InferencePool", "HTTPRoute", "PrometheusRule", "ServiceMonitor",
                                               "ScaledObject"}
    for doc in custom:
        validator = _validators().get((doc["apiVersion"], doc["kind"]))
        assert validator is not None, f"{doc['kind']} is {doc['apiVersion']}, not the CRD's served version"
        errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]
        assert not errors, f"{doc['kind']}/{doc['metadata']['name']}: {errors}"
    for doc in docs:  # and the built-in objects the new components add (the Job, its ConfigMap)
        if doc not in custom:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_crd_validation_rejects_an_unknown_field_and_a_wrong_type() -> None:
    docs = _render("dev", ("inference-gateway",))
    pool = copy.deepcopy(next(d for d in docs if d["kind"] == "InferencePool"))
    validator = _validators()[("inference.networking.k8s.io/v1", "InferencePool")]
    pool["spec"]["targetPortNumber"] = 8000  # the field's name before v1
    assert not validator.is_valid(pool)
    del pool["spec"]["targetPortNumber"]
    pool["spec"]["targetPorts"] = [{"number": "8000"}]
    assert not validator.is_valid(pool)


def test_the_token_secret_example_validates() -> None:
    example = REPO / "k8s" / "components" / "model-volume" / "hf-token-secret.example.yaml"
    secret = yaml.safe_load(example.read_text())
    kubernetes_validate.validate(secret, KUBERNETES_VERSION, strict=True)
    assert "hf-token-secret.example.yaml" not in (example.parent / "kustomization.yaml").read_text().split(
        "resources:")[1]  # an example: never applied with a placeholder token


def test_the_inference_pool_routes_to_the_router_http_port() -> None:
    docs = _render("dev", ("inference-gateway",))
    pool = next(d for d in docs if d["kind"] == "InferencePool")
    route = next(d for d in docs if d["kind"] == "HTTPRoute")
    router = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "pdserve-router")
    labels = router["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(key) == value for key, value in pool["spec"]["selector"]["matchLabels"].items())
    http = next(p["containerPort"] for p in router["spec"]["template"]["spec"]["containers"][0]["ports"]
                if p["name"] == "http")
    assert pool["spec"]["targetPorts"] == [{"number": http}]
    backend = route["spec"]["rules"][0]["backendRefs"][0]
    assert (backend["group"], backend["kind"], backend["name"]) == (
        "inference.networking.k8s.io", "InferencePool", pool["metadata"]["name"])
    assert pool["metadata"].get("namespace") == route["metadata"].get("namespace")  # a route reaches its own


def test_the_fill_job_writes_the_folder_the_pods_load() -> None:
    docs = _render("gpu", ("model-volume",))
    job = next(d for d in docs if d["kind"] == "Job")
    container = job["spec"]["template"]["spec"]["containers"][0]
    local_dir = container["args"][container["args"].index("--local-dir") + 1]
    decode = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "pdserve-decode")
    args = decode["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--model") + 1] == local_dir
    mount = next(m for m in container["volumeMounts"] if m["name"] == "models")
    assert not mount.get("readOnly") and local_dir.startswith(mount["mountPath"] + "/")
    claim = next(d for d in docs if d["kind"] == "PersistentVolumeClaim")
    assert "ReadWriteMany" in claim["spec"]["accessModes"]  # the Job writes, every pod reads
    assert container["env"][0]["valueFrom"]["secretKeyRef"]["name"] == "pdserve-hf-token"
    assert job["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"] != "pdserve"  # egress


def _exported_names() -> set[str]:
    from prometheus_client import CollectorRegistry

    from router.metrics import RouterMetrics
    from shared.serving.server.metrics import ServiceMetrics

    names = set()
    for registry in (ServiceMetrics().registry, RouterMetrics(CollectorRegistry()).registry):
        for family in registry.collect():
            base = family.name
            names |= {base, f"{base}_total", f"{base}_bucket", f"{base}_count", f"{base}_sum"}
    return names


def _expressions() -> list[str]:
    rules = yaml.safe_load((REPO / "k8s" / "components" / "alerts" / "prometheus-rules.yaml").read_text())
    found = [rule["expr"] for group in rules["spec"]["groups"] for rule in group["rules"]]
    dashboard = json.loads(DASHBOARD.read_text())
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            for variable, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(variable, value)
            found.append(expr)
    return found


def test_alerts_and_dashboard_queries_parse_and_name_exported_metrics() -> None:
    exported = _exported_names()
    expressions = _expressions()
    assert len(expressions) >= 14
    for expr in expressions:
        promql_parser.parse(expr)  # raises on a syntax error
        for name in re.findall(r"\bpdserve_\w+", expr):
            assert name in exported, f"{name} is not a metric pdserve exports ({expr})"
    every = " ".join(expressions)
    for shown in ("ttft_seconds", "tpot_seconds", "kv_pulls_total", "transport_failures_total", "held_for_peer"):
        assert shown in every

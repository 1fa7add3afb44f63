"""The split system with mutual TLS on every hop and a bearer token on the router: a client with a
certificate and the token is served (and decode pulled the KV from prefill over TLS), plaintext and
certificate-less clients are refused, a missing or wrong token is UNAUTHENTICATED, and the CLI speaks it.
The router's HTTP API serves HTTPS with the same certificate and mTLS."""
from __future__ import annotations

import os
import ssl
import subprocess
import sys
import urllib.request

import grpc
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from certs import CertificateAuthority
from pdserve.client import PdserveClient
from pdserve.launcher import LocalCluster
from proto.pdserve.v1 import common_pb2, prefill_pb2_grpc
from shared.engine.llm_engine import LLMEngine
from shared.engine.request import SamplingParams
from shared.engine.sched_config import CacheConfig, SchedulerConfig
from shared.serving.server.tls import TlsConfig
from split_cluster import BLOCK_SIZE, MODEL_ARGS, NUM_BLOCKS

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

TOKEN = "e2e-token-0123456789"
PROMPT = list(range(100, 140))
SAMPLING = dict(max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tls-cluster")
    ca = CertificateAuthority(directory)
    service, client = ca.issue("service"), ca.issue("client")
    tls_args = ["--tls-cert", str(service.cert), "--tls-key", str(service.key), "--tls-ca", str(ca.cert_path)]
    token_file = directory / "api-token"
    token_file.write_text(TOKEN)
    client_tls = TlsConfig(tls_cert=str(client.cert), tls_key=str(client.key), tls_ca=str(ca.cert_path))
    with LocalCluster.start(
        pod_args=[*MODEL_ARGS, *tls_args], router_args=[*tls_args, "--api-token-file", str(token_file)],
        with_metrics=True, log_dir=directory / "logs", client_tls=client_tls,
    ) as cluster:
        yield cluster, client_tls, ca, token_file


def _generate(address: str, tls: TlsConfig, token: str | None) -> list[int]:
    with PdserveClient(address, tls=tls, api_token=token) as client:
        return [t for chunk in client.generate(PROMPT, timeout=60, **SAMPLING) for t in chunk.token_ids]


def _router_pulls(cluster) -> float:
    with urllib.request.urlopen(cluster.router.metrics_url, timeout=5) as answer:
        text = answer.read().decode()
    return sum(
        sample.value for family in text_string_to_metric_families(text) for sample in family.samples
        if sample.name == "pdserve_router_kv_pulls_total" and sample.labels.get("outcome") == "pulled"
    )


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as error:
        call()
    return error.value.code()


def test_mtls_cluster_serves_a_request_with_the_kv_pulled_over_tls(secured):
    cluster, client_tls, _, _ = secured
    reference = LLMEngine("tiny", SchedulerConfig(max_model_len=2048), CacheConfig(block_size=BLOCK_SIZE,
                                                                                    num_blocks=NUM_BLOCKS))
    pulls_before = _router_pulls(cluster)
    tokens = _generate(cluster.router.address, client_tls, TOKEN)
    assert tokens == reference.generate([PROMPT], SamplingParams(**SAMPLING))[0].token_ids
    assert _router_pulls(cluster) == pulls_before + 1  # decode -> prefill (GetKvSource, ReleaseKv) spoke mTLS


def test_plaintext_and_certificate_less_clients_are_refused_everywhere(secured):
    cluster, _, ca, _ = secured
    no_cert = TlsConfig(tls_ca=str(ca.cert_path))
    assert _code(lambda: _generate(cluster.router.address, TlsConfig(), TOKEN)) == grpc.StatusCode.UNAVAILABLE
    assert _code(lambda: _generate(cluster.router.address, no_cert, TOKEN)) == grpc.StatusCode.UNAVAILABLE
    for tls in (TlsConfig(), no_cert):
        with tls.channel(cluster.by_name("prefill-0").address) as channel:
            stub = prefill_pb2_grpc.PrefillServiceStub(channel)
            assert _code(lambda: stub.GetLoad(common_pb2.GetLoadRequest(), timeout=5)) == grpc.StatusCode.UNAVAILABLE


def test_missing_or_wrong_token_is_unauthenticated(secured):
    cluster, client_tls, _, _ = secured
    for token in (None, "wrong-token"):
        assert _code(lambda: _generate(cluster.router.address, client_tls, token)) == grpc.StatusCode.UNAUTHENTICATED


def test_cli_generate_speaks_mtls_with_a_token(secured):
    cluster, client_tls, _, token_file = secured
    command = [
        sys.executable, "-m", "pdserve.cli", "generate", "--target", cluster.router.address,
        "--token-ids", ",".join(map(str, PROMPT)), "--max-tokens", "3", "--ignore-eos",
        "--tls-cert", client_tls.tls_cert, "--tls-key", client_tls.tls_key, "--tls-ca", client_tls.tls_ca,
        "--api-token-file", str(token_file),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert done.returncode == 0, done.stderr
    assert "3 tokens" in done.stdout


def test_health_probe_command_speaks_mtls(secured):
    """The command the k8s tls Component probes with (kubelet's own gRPC probe cannot speak TLS)."""
    cluster, client_tls, _, _ = secured
    base = [sys.executable, "-m", "pdserve.cli", "health", "--target", cluster.by_name("prefill-0").address]
    with_tls = [*base, "--tls-cert", client_tls.tls_cert, "--tls-key", client_tls.tls_key,
                "--tls-ca", client_tls.tls_ca]
    done = subprocess.run(with_tls, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "SERVING" in done.stdout, done.stderr
    done = subprocess.run(base, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "UNAVAILABLE" in done.stderr


def test_router_http_api_is_https_with_mtls_and_the_token(secured):
    cluster, client_tls, ca, _ = secured
    assert cluster.router.http_url.startswith("https://")
    with_cert = ssl.create_default_context(cafile=str(ca.cert_path))
    with_cert.load_cert_chain(client_tls.tls_cert, client_tls.tls_key)
    with openai.OpenAI(base_url=cluster.router.http_url, api_key=TOKEN, max_retries=0, timeout=60,
                       http_client=httpx.Client(verify=with_cert)) as client:
        answer = client.completions.create(model="pdserve", prompt=PROMPT, max_tokens=3, extra_body={"ignore_eos": True})
        assert answer.usage.completion_tokens == 3
    no_cert = ssl.create_default_context(cafile=str(ca.cert_path))
    plain_url = cluster.router.http_url.replace("https://", "http://")
    for url, verify in ((cluster.router.http_url, no_cert), (plain_url, True)):
        with openai.OpenAI(base_url=url, api_key=TOKEN, max_retries=0, timeout=10,
                           http_client=httpx.Client(verify=verify)) as refused:
            with pytest.raises(openai.APIConnectionError):
                refused.models.list()

"""The HTTP API under the service's TLS settings, driven by the official `openai` client: HTTPS with the
service's certificate, client certificates required under mTLS (as its gRPC servers), plain HTTP and
certificate-less clients refused; the bearer scheme read case-insensitively. In process (an echo
Generate behind HttpFront), and the colocated server as a process with its announced https URL."""
from __future__ import annotations

import asyncio
import contextlib
import re
import ssl
import time

import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry

from certs import make_pki, server_tls
from shared.engine.request import FinishReason
from shared.serving.generation import GenerateChunk, GenerateInput
from shared.serving.server.http_server import HttpServer
from shared.serving.openai.app import HttpFront
from shared.serving.server.tls import TlsConfig

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]

TOKEN = "https-token-0123"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


async def _echo(work: GenerateInput, on_end=None):
    ids = list(work.prompt)
    yield GenerateChunk("r", token_ids=ids, text="echo", num_prompt_tokens=len(ids), num_output_tokens=len(ids),
                        finish_reason=FinishReason.LENGTH)


@contextlib.asynccontextmanager
async def _serving(tls: TlsConfig, api_key: str | None = None):
    """An HttpFront over the echo Generate, served by HttpServer with tls; yields its base URL."""
    front = HttpFront(_echo, model_name="echo", codec=lambda: None, registry=CollectorRegistry(),
                      is_ready=lambda: True, api_key=api_key)
    server = HttpServer(front.app, "127.0.0.1", 0, tls)
    await server.start()
    try:
        yield server.url
    finally:
        await server.stop()


def _client_context(pki, cert_name: str | None) -> ssl.SSLContext:
    """What an HTTPS client verifies the server with (the CA file), presenting cert_name's certificate."""
    context = ssl.create_default_context(cafile=str(pki["ca"].cert_path))
    if cert_name is not None:
        context.load_cert_chain(str(pki[cert_name].cert), str(pki[cert_name].key))
    return context


def _openai(url: str, verify: ssl.SSLContext | bool = True) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=5,
                              http_client=httpx.AsyncClient(verify=verify))


async def _complete(client: openai.AsyncOpenAI) -> str:
    answer = await client.completions.create(model="echo", prompt=[1, 2, 3], max_tokens=3)
    return answer.choices[0].text


def test_https_serves_the_openai_client_with_the_services_certificate_and_refuses_plain_http(pki):
    async def scenario():
        async with _serving(server_tls(pki, mutual=False)) as url:
            assert url.startswith("https://")
            async with _openai(url, _client_context(pki, None)) as client:
                assert await _complete(client) == "echo"
                assert [m.id for m in (await client.models.list()).data] == ["echo"]
            async with _openai(url.replace("https://", "http://")) as plain:
                with pytest.raises(openai.APIConnectionError):
                    await _complete(plain)

    asyncio.run(scenario())


def test_mtls_refuses_clients_without_a_certificate_of_its_ca(pki):
    async def scenario():
        async with _serving(server_tls(pki, mutual=True)) as url:
            async with _openai(url, _client_context(pki, "client")) as client:
                assert await _complete(client) == "echo"
            for name in (None, "rogue_client"):
                async with _openai(url, _client_context(pki, name)) as refused:
                    with pytest.raises(openai.APIConnectionError):
                        await _complete(refused)

    asyncio.run(scenario())


def test_http_tls_needs_a_certificate_to_serve(pki):
    with pytest.raises(ValueError, match="needs --tls-cert"):
        HttpServer(None, "127.0.0.1", 0, TlsConfig(tls_ca=str(pki["ca"].cert_path)))
    assert HttpServer(None, "127.0.0.1", 0).url.startswith("http://")


def test_bearer_scheme_is_case_insensitive_and_a_wrong_token_is_401():
    async def scenario():
        async with _serving(TlsConfig(), api_key=TOKEN) as url:
            async with httpx.AsyncClient(base_url=url, timeout=5) as client:
                for value in (f"Bearer {TOKEN}", f"bearer {TOKEN}", f"BEARER  {TOKEN}"):
                    answer = await client.get("/v1/models", headers={"authorization": value})
                    assert answer.status_code == 200, value
                for value in (None, "Bearer wrong", f"Basic {TOKEN}", TOKEN, f"Bearer {TOKEN}x", "Bearer ünï"):
                    headers = {} if value is None else {"authorization": value.encode()}
                    answer = await client.get("/v1/models", headers=headers)
                    assert answer.status_code == 401, value
                    assert answer.json()["error"]["type"] == "authentication_error"

    asyncio.run(scenario())


@pytest.mark.timeout(150)
def test_colocated_server_announces_and_serves_https_under_mtls(pki, tmp_path):
    """The composition root's wiring: --tls-* turn the colocated --http-port into HTTPS with mTLS."""
    from pdserve.launcher import HOST, free_port, start_service, wait_serving

    server, ca = pki["server"], str(pki["ca"].cert_path)
    port, http_port = free_port(), free_port()
    service = start_service(
        "colocated", "colocated_svc",
        ["--host", HOST, "--port", str(port), "--model", "tiny", "--num-blocks", "256", "--http-port", str(http_port),
         "--tls-cert", str(server.cert), "--tls-key", str(server.key), "--tls-ca", ca],
        address=f"{HOST}:{port}", log_dir=tmp_path, env={"OMP_NUM_THREADS": "1"},
    )
    try:
        client_tls = TlsConfig(tls_cert=str(pki["client"].cert), tls_key=str(pki["client"].key), tls_ca=ca)
        wait_serving(service, timeout_s=120, tls=client_tls)
        url = _announced_http_url(service.log_path)
        assert url == f"https://{HOST}:{http_port}/v1"

        async def scenario():
            async with _openai(url.removesuffix("/v1"), _client_context(pki, "client")) as client:
                answer = await client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=2,
                                                         extra_body={"ignore_eos": True})
                assert answer.usage.completion_tokens == 2
            async with _openai(url.removesuffix("/v1"), _client_context(pki, None)) as refused:
                with pytest.raises(openai.APIConnectionError):
                    await refused.models.list()

        asyncio.run(scenario())
    finally:
        service.stop()


def _announced_http_url(log_path, timeout_s: float = 10.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = re.search(r"HTTP API at (\S+)", log_path.read_text())
        if found:
            return found.group(1)
        time.sleep(0.1)
    raise AssertionError(f"no HTTP API line in {log_path}")

"""TLS, mTLS and the bearer token on one in-process gRPC server: a client with the right certificate and
token is served; plaintext, a missing client certificate, a certificate from another CA, and a missing or
wrong token are refused; health stays open to TLS clients without a token."""
from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from certs import CertificateAuthority, make_pki, server_tls
from pdserve.client import AsyncPdserveClient, PdserveClient
from proto.pdserve.v1 import generate_pb2, generate_pb2_grpc
from shared.serving.server.api_auth import ApiAuthConfig, BearerTokenInterceptor, bearer_metadata
from shared.serving.server.grpc_server import GrpcServer, ServerOptions
from shared.serving.server.tls import TlsConfig

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]

SERVICE = "pdserve.v1.GenerateService"
TOKEN = "s3cret-token"


class EchoGenerate(generate_pb2_grpc.GenerateServiceServicer):
    async def Generate(self, request, context):
        yield generate_pb2.GenerateResponse(token_ids=list(request.token_ids.ids))


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


async def _generate(channel: grpc.aio.Channel, token: str | None) -> list[int]:
    stub = generate_pb2_grpc.GenerateServiceStub(channel)
    request = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=[1, 2, 3]))
    return [t async for m in stub.Generate(request, timeout=5, metadata=bearer_metadata(token)) for t in m.token_ids]


def _echo_server(tls: TlsConfig, token: str | None = None) -> GrpcServer:
    interceptors = [BearerTokenInterceptor(token)] if token else []
    server = GrpcServer(ServerOptions(grace_seconds=0, tls=tls), interceptors)
    server.add_service(generate_pb2_grpc.add_GenerateServiceServicer_to_server, EchoGenerate(), SERVICE)
    return server


def _run(pki, *, mutual: bool, token: str | None, scenario):
    async def main():
        server = _echo_server(server_tls(pki, mutual=mutual), token)
        await server.start()
        try:
            await scenario(server.address)
        finally:
            await server.stop(0)

    asyncio.run(main())


def _client(pki, cert_name: str | None) -> TlsConfig:
    if cert_name is None:
        return TlsConfig(tls_ca=str(pki["ca"].cert_path))
    files = pki[cert_name]
    return TlsConfig(tls_cert=str(files.cert), tls_key=str(files.key), tls_ca=str(pki["ca"].cert_path))


async def _code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await call
    return error.value.code()


def test_tls_serves_a_tls_client_and_refuses_plaintext(pki):
    async def scenario(address):
        async with _client(pki, None).aio_channel(address) as channel:
            assert await _generate(channel, None) == [1, 2, 3]
        async with grpc.aio.insecure_channel(address) as channel:
            assert await _code_of(_generate(channel, None)) == grpc.StatusCode.UNAVAILABLE

    _run(pki, mutual=False, token=None, scenario=scenario)


def test_mtls_refuses_clients_without_a_certificate_of_its_ca(pki):
    async def scenario(address):
        async with _client(pki, "client").aio_channel(address) as channel:
            assert await _generate(channel, None) == [1, 2, 3]
        for name in (None, "rogue_client"):
            async with _client(pki, name).aio_channel(address) as channel:
                assert await _code_of(_generate(channel, None)) == grpc.StatusCode.UNAVAILABLE, name

    _run(pki, mutual=True, token=None, scenario=scenario)


def test_bearer_token_missing_or_wrong_is_unauthenticated_and_health_stays_open(pki):
    async def scenario(address):
        async with _client(pki, "client").aio_channel(address) as channel:
            assert await _generate(channel, TOKEN) == [1, 2, 3]
            for token in (None, "wrong"):
                assert await _code_of(_generate(channel, token)) == grpc.StatusCode.UNAUTHENTICATED, token
            # The scheme in any case (RFC 7235), as over HTTP.
            lower = (("authorization", f"bearer {TOKEN}"),)
            stub = generate_pb2_grpc.GenerateServiceStub(channel)
            request = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=[4]))
            assert [m.token_ids[0] async for m in stub.Generate(request, timeout=5, metadata=lower)] == [4]
            health = health_pb2_grpc.HealthStub(channel)
            answer = await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert answer.status == health_pb2.HealthCheckResponse.NOT_SERVING  # answered, no token needed

    _run(pki, mutual=True, token=TOKEN, scenario=scenario)


def test_tls_settings_are_checked_where_they_are_given(tmp_path, pki):
    with pytest.raises(ValueError, match="go together"):
        TlsConfig(tls_cert=str(pki["server"].cert))
    with pytest.raises(ValueError, match="no such file"):
        TlsConfig(tls_ca=str(tmp_path / "missing.pem"))
    with pytest.raises(ValueError, match="needs --tls-cert"):
        TlsConfig(tls_ca=str(pki["ca"].cert_path)).server_credentials()
    assert TlsConfig().channel_credentials() is None and TlsConfig().server_credentials() is None
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    assert ApiAuthConfig(api_token_file=str(token_file)).load({}) == TOKEN
    assert ApiAuthConfig().load({"PDSERVE_API_TOKEN": "abc"}) == "abc"
    assert ApiAuthConfig().load({}) is None


def test_the_python_clients_strip_a_token_read_from_a_file(pki, tmp_path):
    """A token read with open(f).read() ends in a newline; the servers strip theirs, the clients too."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\r\n")

    async def scenario(address):
        tls = _client(pki, "client")
        async with AsyncPdserveClient(address, tls=tls, api_token=token_file.read_text()) as client:
            assert [t async for chunk in client.generate([1, 2], timeout=5) for t in chunk.token_ids] == [1, 2]

        def blocking() -> list[int]:
            with PdserveClient(address, tls=tls, api_token=f" {TOKEN}\n") as client:
                return [t for chunk in client.generate([3], timeout=5) for t in chunk.token_ids]

        assert await asyncio.to_thread(blocking) == [3]

    _run(pki, mutual=True, token=TOKEN, scenario=scenario)


def test_a_client_ca_only_the_router_trusts_keeps_client_certificates_off_the_pods(tmp_path):
    """One CA for the services, another for clients: the router's --tls-ca holds both (it checks clients
    and pods with it), the pods' only the services' CA. A client certificate then reaches the router and
    not the pods, while the router's own certificate still reaches them."""
    services, clients = CertificateAuthority(tmp_path, "service-ca"), CertificateAuthority(tmp_path, "client-ca")
    both = tmp_path / "router-ca.pem"
    both.write_bytes(services.cert_path.read_bytes() + clients.cert_path.read_bytes())
    router_cert, pod_cert, client_cert = services.issue("router"), services.issue("pod"), clients.issue("client")
    router_tls = TlsConfig(tls_cert=str(router_cert.cert), tls_key=str(router_cert.key), tls_ca=str(both))
    pod_tls = TlsConfig(tls_cert=str(pod_cert.cert), tls_key=str(pod_cert.key), tls_ca=str(services.cert_path))
    client_tls = TlsConfig(tls_cert=str(client_cert.cert), tls_key=str(client_cert.key),
                           tls_ca=str(services.cert_path))

    async def main():
        router, pod = _echo_server(router_tls), _echo_server(pod_tls)
        await router.start()
        await pod.start()
        try:
            async with client_tls.aio_channel(router.address) as channel:
                assert await _generate(channel, None) == [1, 2, 3]
            async with router_tls.aio_channel(pod.address) as channel:  # the router's (and a pod's) hop
                assert await _generate(channel, None) == [1, 2, 3]
            async with client_tls.aio_channel(pod.address) as channel:
                assert await _code_of(_generate(channel, None)) == grpc.StatusCode.UNAVAILABLE
        finally:
            await router.stop(0)
            await pod.stop(0)

    asyncio.run(main())

"""uvicorn serving an ASGI app on the running event loop (the gRPC server's): HTTPS, and mTLS, by the
service's TLS settings; the gRPC server owns the signals."""
from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from typing import Any

import uvicorn

from shared.serving.server.drain import Drain, DrainMiddleware
from shared.serving.server.tls import TlsConfig


class _Uvicorn(uvicorn.Server):
    def capture_signals(self):
        # The gRPC server owns SIGTERM/SIGINT and stops this one with it.
        return contextlib.nullcontext()


def _uvicorn_tls(tls: TlsConfig) -> dict[str, Any]:
    """uvicorn's TLS settings for a service's TlsConfig, the same rule as its gRPC servers: HTTPS with its
    certificate when it has TLS on, and client certificates required and checked against --tls-ca when
    that is given (mTLS). Plain HTTP when TLS is off."""
    tls.require_server_certificate()
    if not tls.is_enabled:
        return {}
    options: dict[str, Any] = dict(ssl_certfile=tls.tls_cert, ssl_keyfile=tls.tls_key)
    if tls.tls_ca:
        options.update(ssl_ca_certs=tls.tls_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
    return options


class HttpServer:
    """uvicorn serving an app on the running event loop; HTTPS (and mTLS) when tls says so."""

    def __init__(self, app, host: str, port: int, tls: TlsConfig = TlsConfig()):
        self._app = app
        self.host = host
        self._tls_options = _uvicorn_tls(tls)  # checked before the port is bound
        self._socket = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._socket.bind((host, port))
        except OSError as exc:
            self._socket.close()
            raise OSError(f"cannot bind HTTP port {host}:{port}: {exc}") from None
        self.port = self._socket.getsockname()[1]
        self._server: _Uvicorn | None = None
        self._task: asyncio.Task | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        scheme = "https" if self._tls_options else "http"
        return f"{scheme}://{host}:{self.port}"

    async def start(self, drain: Drain | None = None) -> None:
        """Serves; with drain (the gRPC server's), its requests in flight are counted and ended at the
        drain's deadline with the gRPC server's calls (shared/serving/server/drain.py)."""
        app = self._app if drain is None else DrainMiddleware(self._app, drain)
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", **self._tls_options)
        self._server = _Uvicorn(config)
        self._task = asyncio.ensure_future(self._server.serve(sockets=[self._socket]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise OSError(f"the HTTP server on {self.url} stopped while starting")
            await asyncio.sleep(0.01)

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stops accepting at once; requests in flight get grace_s to finish (the drain ends them first)."""
        if self._server is None or self._task is None:
            return
        self._server.config.timeout_graceful_shutdown = grace_s
        self._server.should_exit = True
        await self._task
        self._server = None

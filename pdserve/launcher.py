"""Starting pdserve services as local OS processes: free ports, health waits, and stopping exactly the
processes started here (by pid). Used by `pdserve up`, the tests and the benchmarks."""
from __future__ import annotations

import argparse
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.serving.server.handle_key import KEY_ENV_VAR
from shared.serving.server.settings import add_flags, config_from_args
from shared.serving.server.tls import TlsConfig

HOST = "127.0.0.1"
# Loading a model and registering its KV pool takes seconds; a cold CI machine can be slow.
DEFAULT_START_TIMEOUT_S = 120.0


# Where free_port() looks: below Linux's ephemeral range (32768-60999), which the kernel also hands to
# every outgoing connection, so a port picked there can be taken by some client's connect() before the
# service binds it; and clear of the KV transfer ports (20000-20099 by default).
_SERVICE_PORTS = range(10000, 20000)
# Every port free_ports() has returned in this process: one is not bound until its service starts, so
# without this a cluster's next pick (a metrics port, another pod) could be the same port.
_handed_out: set[int] = set()


def free_port(host: str = HOST) -> int:
    """A port nothing listens on right now (the service binds it a moment later)."""
    return free_ports(1, host)


def free_ports(count: int, host: str = HOST) -> int:
    """The first of `count` consecutive ports nothing listens on right now: for a tier of pods given one
    port, whose next pods take the following ports."""
    for _ in range(100):
        first = secrets.choice(_SERVICE_PORTS)
        run = range(first, first + count)
        if not _handed_out.intersection(run) and all(_can_bind(host, port) for port in run):
            _handed_out.update(run)
            return first
    raise RuntimeError(f"no free port run of {count} from {_SERVICE_PORTS[0]}-{_SERVICE_PORTS[-1]} on {host}")


def _can_bind(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False  # in use
        return True


@dataclass
class ServiceProcess:
    name: str
    address: str
    process: subprocess.Popen
    log_path: Path | None = None
    metrics_url: str | None = None
    http_url: str | None = None  # the OpenAI-compatible API's base URL (…/v1), when it serves one
    cores: tuple[int, ...] | None = None  # the CPUs it is pinned to (None: any this process may use)

    @property
    def pid(self) -> int:
        return self.process.pid

    def is_running(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, num_chars: int = 4000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def failure_summary(self) -> str:
        """One line for a user: the log's last line (a crash ends with its exception) and where the log is;
        then the log's tail."""
        tail = self.log_tail()
        lines = [line.strip() for line in tail.splitlines() if line.strip()]
        where = f"(log: {self.log_path})" if self.log_path is not None else ""
        return f"{lines[-1] if lines else 'no output'} {where}\n{tail}"

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM (graceful drain), then SIGKILL if it does not exit in time."""
        if not self.is_running():
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout_s)


def start_service(
    name: str,
    module: str,
    args: Sequence[str],
    *,
    address: str,
    log_dir: Path | None = None,
    env: dict[str, str] | None = None,
    cores: Sequence[int] | None = None,
) -> ServiceProcess:
    """Run `python -m module args...`; output goes to log_dir/name.log (or is inherited). cores: pin it to
    these CPUs (set before it has imported anything, so every thread torch starts later inherits them)."""
    log_path = None
    stdout = None
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"{name}.log"
        stdout = open(log_path, "wb")  # the child owns the handle; closed when we drop it
    child_env = {**os.environ, **(env or {})}
    # Huge pages for the KV pool make NIXL reads much faster (DESIGN.md section 3).
    child_env.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    process = subprocess.Popen(
        [sys.executable, "-m", module, *args],
        stdout=stdout,
        stderr=subprocess.STDOUT if stdout is not None else None,
        env=child_env,
    )
    if stdout is not None:
        stdout.close()
    if cores is not None:
        os.sched_setaffinity(process.pid, cores)
    return ServiceProcess(name=name, address=address, process=process, log_path=log_path,
                          cores=tuple(cores) if cores is not None else None)


def wait_serving(
    service: ServiceProcess, timeout_s: float = DEFAULT_START_TIMEOUT_S, tls: TlsConfig = TlsConfig()
) -> None:
    """Block until the standard health service says SERVING; RuntimeError if the process dies or times out.
    tls: what the health check connects with (the services' client TLS settings)."""
    deadline = time.monotonic() + timeout_s
    # Reconnect every few ms: gRPC's default backoff (1 s and growing) would sleep past the moment
    # the port opens while the model loads.
    options = [("grpc.initial_reconnect_backoff_ms", 10), ("grpc.min_reconnect_backoff_ms", 10),
               ("grpc.max_reconnect_backoff_ms", 100)]
    with tls.channel(service.address, options=options) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if not service.is_running():
                raise RuntimeError(
                    f"{service.name} exited with {service.process.returncode}: {service.failure_summary()}")
            try:
                answer = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                if answer.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass  # not listening yet
            time.sleep(0.1)
    raise RuntimeError(f"{service.name} at {service.address} not SERVING after {timeout_s} s: "
                       f"{service.failure_summary()}")


def split_cores(num_pods: int, cores: Sequence[int] | None = None) -> list[tuple[int, ...]] | None:
    """Disjoint runs of this process's CPUs, one per pod, as even as they divide (the first pods take one
    more), so pods on one machine never contend for a core; None when there are more pods than CPUs."""
    cores = sorted(os.sched_getaffinity(0) if cores is None else cores)
    if num_pods < 1 or num_pods > len(cores):
        return None
    share, extra = divmod(len(cores), num_pods)
    out, start = [], 0
    for pod in range(num_pods):
        size = share + (1 if pod < extra else 0)
        out.append(tuple(cores[start:start + size]))
        start += size
    return out


def cores_text(cores: Sequence[int] | None) -> str:
    """0-3,6 for (0, 1, 2, 3, 6); "any" for None."""
    if not cores:
        return "any"
    runs, first = [], None
    for i, core in enumerate(cores):
        first = core if first is None else first
        if i + 1 == len(cores) or cores[i + 1] != core + 1:
            runs.append(str(core) if first == core else f"{first}-{core}")
            first = None
    return ",".join(runs)


@dataclass(frozen=True)
class ClusterPorts:
    """The ports a local cluster binds; None picks a free one. Pod ports are the first pod's (the
    next pods of a tier take the following ports)."""

    router: int | None = None
    http: int | None = None  # the router's OpenAI-compatible HTTP API
    prefill: int | None = None
    decode: int | None = None


# `pdserve up` binds these (documented in the README); `generate`, `bench` and the README's snippets
# default to them.
DEFAULT_PORTS = ClusterPorts(router=50051, http=8000, prefill=50052, decode=50053)


def new_cluster_env() -> dict[str, str]:
    """The environment every service of one local cluster shares: a fresh random KV handle key."""
    return {KEY_ENV_VAR: secrets.token_hex(32)}


@dataclass
class LocalCluster:
    """Router + prefill pods + decode pods on 127.0.0.1, each its own process. Every service started
    through it gets `env` (with the cluster's own KV handle key); pass it to pods started beside it."""

    with_metrics: bool = False  # give every service a Prometheus port (ServiceProcess.metrics_url)
    services: list[ServiceProcess] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=new_cluster_env)
    client_tls: TlsConfig = TlsConfig()  # how this side (health waits) connects to the services

    @property
    def router(self) -> ServiceProcess:
        return next(s for s in self.services if s.name == "router")

    def by_name(self, name: str) -> ServiceProcess:
        return next(s for s in self.services if s.name == name)

    @classmethod
    def start(
        cls,
        *,
        pod_args: Sequence[str] = (),
        prefill_args: Sequence[str] = (),
        decode_args: Sequence[str] = (),
        router_args: Sequence[str] = (),
        num_prefill: int = 1,
        num_decode: int = 1,
        with_metrics: bool = False,
        log_dir: Path | None = None,
        env: dict[str, str] | None = None,
        timeout_s: float = DEFAULT_START_TIMEOUT_S,
        ports: ClusterPorts = ClusterPorts(),
        client_tls: TlsConfig = TlsConfig(),
        pin_cores: bool = False,
    ) -> "LocalCluster":
        """The router always serves the HTTP API too (ServiceProcess.http_url). client_tls: the TLS
        settings the health waits connect with, when the services' flags turn TLS on. pin_cores: each pod
        gets its own share of this process's CPUs (split_cores) and as many torch threads; with more pods
        than CPUs, one thread each, unpinned. Either way the pods' threads add up to no more than the CPUs
        (when there are at least as many CPUs as pods)."""
        cluster = cls(with_metrics=with_metrics, client_tls=client_tls)
        cluster.env.update(env or {})
        env = cluster.env
        placement = _pod_placement(num_prefill + num_decode, pin_cores)
        try:
            prefill = [cluster.start_process(f"prefill-{i}", "prefill_svc",
                                             [*placement[i][1], *pod_args, *prefill_args], log_dir, env,
                                             _nth_port(ports.prefill, i), placement[i][0])
                       for i in range(num_prefill)]
            decode = [cluster.start_process(f"decode-{i}", "decode_svc",
                                            [*placement[num_prefill + i][1], *pod_args, *decode_args], log_dir, env,
                                            _nth_port(ports.decode, i), placement[num_prefill + i][0])
                      for i in range(num_decode)]
            http_port = ports.http or free_port()
            routing = [f"--prefill={','.join(s.address for s in prefill)}",
                       f"--decode={','.join(s.address for s in decode)}", "--http-port", str(http_port)]
            router = cluster.start_process("router", "router", [*routing, *router_args], log_dir, env, ports.router)
            router.http_url = f"{_http_scheme(router_args)}://{HOST}:{http_port}/v1"
            for service in cluster.services:
                wait_serving(service, timeout_s, cluster.client_tls)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def start_process(self, name: str, module: str, args: Sequence[str], log_dir: Path | None,
                      env: dict[str, str] | None, port: int | None = None,
                      cores: Sequence[int] | None = None) -> ServiceProcess:
        """One more service of the cluster (it does not wait for it to serve): a free port when port is None,
        a metrics port when the cluster has them."""
        port = port or free_port()
        args = ["--host", HOST, "--port", str(port), *args]
        metrics_url = None
        if self.with_metrics:
            metrics_port = free_port()
            args += ["--metrics-port", str(metrics_port)]
            metrics_url = f"http://{HOST}:{metrics_port}/metrics"
        service = start_service(name, module, args, address=f"{HOST}:{port}", log_dir=log_dir, env=env, cores=cores)
        service.metrics_url = metrics_url
        self.services.append(service)
        return service

    def stop(self) -> None:
        for service in reversed(self.services):
            service.stop()

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _http_scheme(router_args: Sequence[str]) -> str:
    """https when the router's flags give it a certificate (its HTTP API then serves it, as gRPC does)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_flags(parser, TlsConfig)
    known, _ = parser.parse_known_args(list(router_args))
    return "https" if config_from_args(TlsConfig, known).tls_cert else "http"


def _pod_placement(num_pods: int, pin_cores: bool) -> list[tuple[tuple[int, ...] | None, list[str]]]:
    """Per pod: (its CPUs or None, the thread flags it starts with; flags passed after them win)."""
    if not pin_cores:
        return [(None, [])] * num_pods
    shares = split_cores(num_pods)
    if shares is None:  # more pods than CPUs: one thread each
        return [(None, ["--num-threads", "1"])] * num_pods
    return [(cores, ["--num-threads", str(len(cores))]) for cores in shares]


def _nth_port(first: int | None, index: int) -> int | None:
    return None if first is None else first + index

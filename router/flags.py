"""The router's configuration: a frozen, validated dataclass built from command-line flags."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from shared.serving.openai.config import HttpConfig
from shared.serving.server.api_auth import ApiAuthConfig
from shared.serving.server.grpc_server import ServerOptions
from shared.serving.prefill_client import PrefillClientConfig
from shared.serving.server.settings import add_flags, config_from_args, setting, settings_group
from shared.serving.server.tls import TlsConfig

from router.kv_index import DEFAULT_MAX_BLOCKS_PER_POD
from router.policy import DisaggregationRule, KvWeights

POLICIES = ("least-loaded", "round-robin", "kv-aware")


@dataclass(frozen=True)
class WorkerSpec:
    """One discovery source: a fixed host:port, a DNS name resolved to every address it has, or a file
    listing host:port lines (re-read as a DNS name is re-resolved: `pdserve up --autoscale` rewrites it)."""

    host: str
    port: int
    is_dns: bool = False
    list_file: str | None = None

    @property
    def is_dynamic(self) -> bool:
        """Whether its addresses can change while the router runs (so it is looked up again periodically)."""
        return self.is_dns or self.list_file is not None

    def __str__(self) -> str:
        if self.list_file is not None:
            return f"file:{self.list_file}"
        return f"dns:{self.host}:{self.port}" if self.is_dns else format_address(self.host, self.port)


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _parse_port(text: str, spec: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise ValueError(f"bad port {text!r} in worker {spec!r} (expected 1-65535)")
    return int(text)


def parse_worker_spec(spec: str) -> WorkerSpec:
    """Parses 'host:port', '[v6]:port', 'dns:NAME:PORT' or 'file:PATH'."""
    text = spec.strip()
    if text.startswith("file:"):
        if not text[len("file:"):]:
            raise ValueError(f"bad worker {spec!r}: expected file:PATH")
        return WorkerSpec(host="", port=0, list_file=text[len("file:"):])
    is_dns = text.startswith("dns:")
    if is_dns:
        text = text[len("dns:"):]
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise ValueError(f"bad worker {spec!r}: expected [ipv6]:port")
        port_text = rest[1:]
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            raise ValueError(f"bad worker {spec!r}: expected host:port or dns:name:port")
    if not host:
        raise ValueError(f"bad worker {spec!r}: empty host")
    return WorkerSpec(host=host, port=_parse_port(port_text, spec), is_dns=is_dns)


def read_worker_file(path: str) -> list[str]:
    """The host:port addresses a worker list file names, one a line (blank lines and # comments skipped);
    ValueError naming the line when one is not a host:port."""
    addresses: list[str] = []
    for number, line in enumerate(open(path, encoding="utf-8").read().splitlines(), start=1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        try:
            spec = parse_worker_spec(text)
        except ValueError as exc:
            raise ValueError(f"{path} line {number}: {exc}") from None
        if spec.is_dynamic:
            raise ValueError(f"{path} line {number}: {text!r}: a worker list file holds host:port lines only")
        address = format_address(spec.host, spec.port)
        if address not in addresses:
            addresses.append(address)
    return addresses


def parse_worker_list(values: list[str] | None) -> tuple[WorkerSpec, ...]:
    """Flattens repeated flags and comma lists; drops duplicates, keeps order."""
    specs: list[WorkerSpec] = []
    for value in values or ():
        for part in value.split(","):
            if part.strip():
                spec = parse_worker_spec(part)
                if spec not in specs:
                    specs.append(spec)
    return tuple(specs)


def _none_if_empty(value: str | None) -> str | None:
    return value or None


@dataclass(frozen=True)
class PoolConfig:
    """How the router keeps track of one tier's workers."""

    health_interval_s: float = field(default=1.0, metadata=setting(
        "seconds between health/load polls", flag="--health-interval"
    ))
    resolve_interval_s: float = field(default=10.0, metadata=setting(
        "seconds between DNS re-resolutions (and re-reads of file: worker lists)", flag="--resolve-interval"
    ))
    probe_timeout_s: float = field(default=1.0, metadata=setting(
        "seconds a health or load probe may take", flag="--probe-timeout"
    ))
    # A busy or briefly paused pod answers a probe late; taking it out of rotation for that would fail
    # requests it is about to serve. One that refuses connections or says it is not serving goes at once.
    slow_probes_to_unhealthy: int = field(default=3, metadata=setting(
        "consecutive timed-out probes that take a healthy worker out of rotation", flag="--slow-probes-to-unhealthy"
    ))

    def __post_init__(self) -> None:
        for name in ("health_interval_s", "resolve_interval_s", "probe_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.slow_probes_to_unhealthy < 1:
            raise ValueError(f"slow_probes_to_unhealthy must be >= 1, got {self.slow_probes_to_unhealthy}")


@dataclass(frozen=True)
class RouterConfig:
    """Every router setting; each field with setting() metadata is a flag (shared/serving/server/settings.py)."""

    prefill: tuple[WorkerSpec, ...] = field(metadata=setting(
        "prefill workers: host:port, dns:name:port or file:PATH (host:port lines, re-read); repeatable or comma "
        "separated",
        parse=parse_worker_list, action="append", metavar="ADDR",
    ))
    decode: tuple[WorkerSpec, ...] = field(metadata=setting(
        "decode workers: host:port, dns:name:port or file:PATH; repeatable or comma separated",
        parse=parse_worker_list, action="append", metavar="ADDR",
    ))
    host: str = field(default="127.0.0.1", metadata=setting("address to listen on"))
    port: int = field(default=50051, metadata=setting("port to listen on (0 picks one)"))
    policy: str = field(default="kv-aware", metadata=setting("how a worker is picked: by cached prefix and load (kv-aware), by load alone, or in turn", choices=POLICIES))
    metrics_port: int | None = field(default=None, metadata=setting("Prometheus /metrics port (off when unset)"))
    otlp_endpoint: str | None = field(default=None, metadata=setting(
        "OTLP gRPC endpoint for traces, e.g. localhost:4317", parse=_none_if_empty
    ))
    tokenizer_path: str | None = field(default=None, metadata=setting(
        "tokenizer.json (or a directory holding one) for text prompts", flag="--tokenizer", parse=_none_if_empty
    ))
    max_prefill_retries: int = field(default=2, metadata=setting("prefill attempts on other workers after a failure"))
    max_decode_retries: int = field(default=2, metadata=setting("decode re-issues on other workers after a failure"))
    stall_timeout_s: float = field(default=5.0, metadata=setting(
        "seconds a decode pod may go without sending a token (before its first, which waits for the KV "
        "pull, and for a prefill pod's answer: while it also fails its health probes) before the router "
        "treats it as frozen and fails the request over",
        flag="--stall-timeout",
    ))
    decode_admit_timeout_s: float = field(default=10.0, metadata=setting(
        "seconds a request with token 1 sent may wait, backing off, for a decode pod that accepts it",
        flag="--decode-admit-timeout",
    ))
    request_timeout_s: float | None = field(default=600.0, metadata=setting(
        "deadline (seconds) for calls that arrive without one", flag="--request-timeout"
    ))
    grace_seconds: float = field(default=ServerOptions.grace_seconds, metadata=setting("graceful shutdown period"))
    pool: PoolConfig = field(default_factory=PoolConfig, metadata=settings_group())
    prefill_client: PrefillClientConfig = field(default_factory=PrefillClientConfig, metadata=settings_group())
    http: HttpConfig = field(default_factory=HttpConfig, metadata=settings_group())
    tls: TlsConfig = field(default_factory=TlsConfig, metadata=settings_group())
    auth: ApiAuthConfig = field(default_factory=ApiAuthConfig, metadata=settings_group())
    kv_weights: KvWeights = field(default_factory=KvWeights, metadata=settings_group())
    disaggregation: DisaggregationRule = field(default_factory=DisaggregationRule, metadata=settings_group())
    kv_index_max_blocks: int = field(default=DEFAULT_MAX_BLOCKS_PER_POD, metadata=setting(
        "most block hashes the router keeps per pod for KV-aware routing (~120 bytes each)"
    ))

    @property
    def needs_kv_index(self) -> bool:
        """Only KV-aware picks and the short-suffix rule look at the pods' prefix caches."""
        return self.policy == "kv-aware" or self.disaggregation.max_local_prefill_tokens > 0

    def __post_init__(self) -> None:
        if not self.prefill:
            raise ValueError("at least one prefill worker is required (--prefill host:port or dns:name:port)")
        if not self.decode:
            raise ValueError("at least one decode worker is required (--decode host:port or dns:name:port)")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        for name in ("max_prefill_retries", "max_decode_retries"):
            if not 0 <= getattr(self, name) <= 10:
                raise ValueError(f"{name} must be in [0, 10], got {getattr(self, name)}")
        for name in ("stall_timeout_s", "decode_admit_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        if self.grace_seconds < 0:
            raise ValueError(f"grace_seconds must be >= 0, got {self.grace_seconds}")
        if self.kv_index_max_blocks < 1:
            raise ValueError(f"kv_index_max_blocks must be >= 1, got {self.kv_index_max_blocks}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "RouterConfig":
        return config_from_args(cls, args)


def build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve router", description="pdserve router: Generate -> prefill -> decode"
    )
    add_flags(parser, RouterConfig)
    return parser

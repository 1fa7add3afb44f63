"""The router's configuration: a frozen, validated dataclass built from command-line flags."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from router.kv_index import DEFAULT_MAX_BLOCKS_PER_POD
from router.policy import DisaggregationRule, KvWeights

POLICIES = ("least-loaded", "round-robin", "kv-aware")


@dataclass(frozen=True)
class WorkerSpec:
    """One discovery source: a fixed host:port, or a DNS name resolved to every address it has."""

    host: str
    port: int
    is_dns: bool = False

    def __str__(self) -> str:
        return f"dns:{self.host}:{self.port}" if self.is_dns else format_address(self.host, self.port)


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _parse_port(text: str, spec: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise ValueError(f"bad port {text!r} in worker {spec!r} (expected 1-65535)")
    return int(text)


def parse_worker_spec(spec: str) -> WorkerSpec:
    """Parses 'host:port', '[v6]:port' or 'dns:NAME:PORT'."""
    text = spec.strip()
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


@dataclass(frozen=True)
class RouterConfig:
    prefill: tuple[WorkerSpec, ...]
    decode: tuple[WorkerSpec, ...]
    host: str = "127.0.0.1"
    port: int = 50051
    policy: str = "least-loaded"
    metrics_port: int | None = None
    otlp_endpoint: str | None = None
    tokenizer_path: str | None = None
    max_prefill_retries: int = 2
    max_decode_retries: int = 2
    health_interval_s: float = 1.0
    resolve_interval_s: float = 10.0
    probe_timeout_s: float = 1.0
    grace_seconds: float = 5.0
    request_timeout_s: float = 600.0  # applies when the client sets no deadline: nothing waits forever
    kv_weights: KvWeights = KvWeights()
    disaggregation: DisaggregationRule = DisaggregationRule()
    kv_index_max_blocks: int = DEFAULT_MAX_BLOCKS_PER_POD

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
        for name in ("health_interval_s", "resolve_interval_s", "probe_timeout_s", "request_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.grace_seconds < 0:
            raise ValueError(f"grace_seconds must be >= 0, got {self.grace_seconds}")
        for name in ("prefix_weight", "load_weight"):
            if not getattr(self.kv_weights, name) >= 0:
                raise ValueError(f"kv {name} must be >= 0, got {getattr(self.kv_weights, name)}")
        for name in ("max_local_prefill_tokens", "saturation_queue"):
            if getattr(self.disaggregation, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self.disaggregation, name)}")
        if self.kv_index_max_blocks < 1:
            raise ValueError(f"kv_index_max_blocks must be >= 1, got {self.kv_index_max_blocks}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "RouterConfig":
        return cls(
            prefill=parse_worker_list(args.prefill),
            decode=parse_worker_list(args.decode),
            host=args.host,
            port=args.port,
            policy=args.policy,
            metrics_port=args.metrics_port,
            otlp_endpoint=args.otlp_endpoint or None,
            tokenizer_path=args.tokenizer or None,
            max_prefill_retries=args.max_prefill_retries,
            max_decode_retries=args.max_decode_retries,
            health_interval_s=args.health_interval,
            resolve_interval_s=args.resolve_interval,
            grace_seconds=args.grace_seconds,
            request_timeout_s=args.request_timeout,
            kv_weights=KvWeights(prefix_weight=args.kv_prefix_weight, load_weight=args.kv_load_weight),
            disaggregation=DisaggregationRule(
                max_local_prefill_tokens=args.local_prefill_below, saturation_queue=args.prefill_saturation_queue
            ),
            kv_index_max_blocks=args.kv_index_max_blocks,
        )


def build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m router", description="pdserve router: Generate -> prefill -> decode"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=50051, help="port to listen on (0 picks one)")
    parser.add_argument("--prefill", action="append", metavar="ADDR",
                        help="prefill workers: host:port or dns:name:port; repeatable or comma separated")
    parser.add_argument("--decode", action="append", metavar="ADDR",
                        help="decode workers: host:port or dns:name:port; repeatable or comma separated")
    parser.add_argument("--policy", choices=POLICIES, default="least-loaded")
    parser.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics port (off when unset)")
    parser.add_argument("--otlp-endpoint", default=None, help="OTLP gRPC endpoint for traces, e.g. localhost:4317")
    parser.add_argument(
        "--tokenizer", default=None, help="tokenizer.json (or a directory holding one) for text prompts"
    )
    parser.add_argument("--max-prefill-retries", type=int, default=2)
    parser.add_argument("--max-decode-retries", type=int, default=2)
    parser.add_argument("--health-interval", type=float, default=1.0, help="seconds between health/load polls")
    parser.add_argument("--resolve-interval", type=float, default=10.0, help="seconds between DNS re-resolutions")
    parser.add_argument("--request-timeout", type=float, default=600.0,
                        help="deadline (seconds) for calls that arrive without one")
    parser.add_argument("--grace-seconds", type=float, default=5.0, help="graceful shutdown period")
    kv = parser.add_argument_group("KV-aware routing (policy kv-aware) and conditional disaggregation")
    kv.add_argument("--kv-prefix-weight", type=float, default=KvWeights.prefix_weight,
                    help="cost of one prompt token a pod lacks in its prefix cache (prefill computes, decode pulls it)")
    kv.add_argument("--kv-load-weight", type=float, default=KvWeights.load_weight,
                    help="cost of one request in a pod's queue, in the same units")
    kv.add_argument("--kv-index-max-blocks", type=int, default=DEFAULT_MAX_BLOCKS_PER_POD,
                    help="most block hashes the router keeps per pod (~120 bytes each)")
    kv.add_argument("--local-prefill-below", type=int, default=0, metavar="TOKENS",
                    help="send a request straight to a decode pod that lacks fewer prompt tokens than this (0: off)")
    kv.add_argument("--prefill-saturation-queue", type=int, default=0, metavar="N",
                    help="prefill is saturated when every prefill pod has N requests waiting; then a decode pod "
                         "with a shorter queue computes the prompt itself (0: off)")
    return parser

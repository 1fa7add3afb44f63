"""The `pdserve` command: run one service, the whole split system on localhost, a streamed
completion against a running router, or the serving benchmark."""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
import traceback
from importlib import metadata

from pdserve.launcher import DEFAULT_PORTS
from pdserve.up import add_up_command

# Subcommands that hand their argv to a service's own composition root.
SERVICE_MODULES = {
    "router": "router.__main__",
    "prefill": "prefill_svc.__main__",
    "decode": "decode_svc.__main__",
    "colocated": "colocated_svc.__main__",
    "planner": "planner.__main__",
}
DEFAULT_TARGET = f"127.0.0.1:{DEFAULT_PORTS.router}"


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    _set_transfer_environment()
    if argv and argv[0] in SERVICE_MODULES:
        sys.exit(importlib.import_module(SERVICE_MODULES[argv[0]]).main(argv[1:]) or 0)
    if argv and argv[0] == "bench":
        sys.exit(importlib.import_module("pdserve.bench").main(argv[1:]))
    args = _parser().parse_args(argv)
    try:
        args.run(args)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as exc:  # noqa: BLE001 - a user-facing command: one line unless --debug
        if args.debug:
            traceback.print_exc()
        else:
            print(f"pdserve {args.command}: {_one_line(exc)} (--debug shows the traceback)", file=sys.stderr)
        sys.exit(1)


def _one_line(exc: BaseException) -> str:
    import grpc

    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        return f"{exc.code().name}: {exc.details()}"
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _token_ids(text: str) -> list[int]:
    """--token-ids: comma-separated integers."""
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        ids = [-1]
    if any(token_id < 0 for token_id in ids):
        sys.exit(f"pdserve generate: --token-ids takes comma-separated non-negative integers, got {text!r}")
    return ids


def _version() -> str:
    try:
        return metadata.version("pdserve")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def _set_transfer_environment() -> None:
    """Before torch and NIXL load: huge pages for the KV pool, CUDA IPC READs on a GPU (both are read once)."""
    from shared.engine.kv_transfer.nixl_loading import recommended_environment

    uses_cuda = os.path.exists("/dev/nvidia0")
    for name, value in recommended_environment(uses_cuda=uses_cuda).items():
        os.environ.setdefault(name, value)


def _parser() -> argparse.ArgumentParser:
    defaults = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    parser.add_argument("--version", action="version", version=f"pdserve {_version()}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="print the traceback of an error")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SERVICE_MODULES:
        commands.add_parser(name, help=f"run one {name} service (see `pdserve {name} --help`)", add_help=False)
    commands.add_parser("bench", help="serving benchmark against a router (see `pdserve bench --help`)", add_help=False)

    add_up_command(commands, [common])

    generate = commands.add_parser("generate", help="stream a completion from a running router",
                                   formatter_class=defaults, parents=[common])
    generate.add_argument("--target", default=DEFAULT_TARGET, help="router address host:port")
    prompt = generate.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (the router needs a tokenizer)")
    prompt.add_argument("--token-ids", help="prompt token ids, comma separated")
    _add_sampling_flags(generate)
    _add_connection_flags(generate)
    generate.set_defaults(run=_run_generate)

    health = commands.add_parser(
        "health", help="exit 0 when a service's gRPC health says SERVING (a probe that speaks TLS)"
    )
    health.add_argument("--target", required=True, help="service address host:port")
    health.add_argument("--service", default="", help="service name to ask about (default: the whole server)")
    health.add_argument("--timeout", type=float, default=3.0, help="seconds the check may take")
    _add_connection_flags(health)
    health.set_defaults(run=_run_health)
    return parser


def _add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=16, help="output tokens at most")
    # Left out, these take the model's generation_config.json defaults, else greedy / off / 1.
    parser.add_argument("--temperature", type=float, default=None, help="0 is greedy (default: the model's, else 0)")
    parser.add_argument("--top-k", type=int, default=None, help="0 is off (default: the model's, else 0)")
    parser.add_argument("--top-p", type=float, default=None, help="nucleus mass (default: the model's, else 1)")
    parser.add_argument("--seed", type=int, default=None, help="per-request seed")
    parser.add_argument("--ignore-eos", action="store_true", help="go on past the end-of-sequence token")
    parser.add_argument("--timeout", type=float, default=60.0, help="deadline of the whole call in seconds")


def _add_connection_flags(parser: argparse.ArgumentParser) -> None:
    """TLS files and the bearer token, for a router that asks for them (the services' own flags)."""
    from pdserve.connection import add_connection_flags

    add_connection_flags(parser)


def _connection(args: argparse.Namespace) -> dict:
    from pdserve.connection import connection_from_args

    try:
        return connection_from_args(args)
    except ValueError as exc:
        sys.exit(f"pdserve {args.command}: {exc}")


def _run_health(args: argparse.Namespace) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    tls = _connection(args)["tls"]
    try:
        with tls.channel(args.target) as channel:
            request = health_pb2.HealthCheckRequest(service=args.service)
            status = health_pb2_grpc.HealthStub(channel).Check(request, timeout=args.timeout).status
    except grpc.RpcError as error:
        sys.exit(f"pdserve health: {args.target}: {error.code().name}: {error.details()}")
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
    print(f"{args.target}: {name}")
    sys.exit(0 if status == health_pb2.HealthCheckResponse.SERVING else 1)


def _run_generate(args: argparse.Namespace) -> None:
    prompt = args.prompt if args.prompt is not None else _token_ids(args.token_ids)
    sampling = dict(max_tokens=args.max_tokens, seed=args.seed, ignore_eos=args.ignore_eos)
    given = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    sampling.update({name: value for name, value in given.items() if value is not None})
    _stream(args.target, prompt, sampling, args.timeout, **_connection(args))


def chunk_output(chunk, as_text: bool) -> str:
    """What a streamed chunk prints: its text for a text prompt (empty while a character is incomplete),
    else its token ids; never ids inside text."""
    if as_text:
        return chunk.text
    return "".join(f"{token_id} " for token_id in chunk.token_ids)


def _stream(target: str, prompt, sampling: dict, timeout: float, **connection) -> None:
    """connection: PdserveClient's tls and api_token."""
    from pdserve.client import PdserveClient

    started = time.monotonic()
    first_at = None
    as_text = isinstance(prompt, str)
    with PdserveClient(target, **connection) as client:
        for chunk in client.generate(prompt, timeout=timeout, **sampling):
            if first_at is None:
                first_at = time.monotonic()
            print(chunk_output(chunk, as_text), end="", flush=True)
            last = chunk
    elapsed = time.monotonic() - started
    print(f"\n[{last.num_output_tokens} tokens, finish {last.finish_reason}, "
          f"TTFT {1000 * (first_at - started):.1f} ms, total {1000 * elapsed:.1f} ms]")


if __name__ == "__main__":
    main()

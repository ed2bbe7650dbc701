"""`tessera`: a small command-line client of the frontend.

    tessera generate "Why is the sky blue?" [--addr HOST:PORT] [--max-tokens N]
                     [--temperature T] [--seed S] [--raw] [--wait SECONDS]
                     [--api-key KEY] [--ca-file PEM [--cert-file PEM --key-file PEM]]
    tessera health [--addr HOST:PORT] [--wait SECONDS]
    tessera health --metrics-addr HOST:PORT
    tessera serve [--model PATH] [any service flag ...]   (tessera.serve)
    tessera bench [--backend openai-chat|openai|grpc] ... (tessera.bench.cli)

`generate` sends the prompt as one user chat message (or as plain text with
--raw), streams the text to stdout as it arrives, then prints a newline and the
usage to stderr. gRPC errors are reported on stderr with a non-zero exit status.
It is a user of tessera.client (the tessera-client distribution), imported only
for `generate`: the service images, which run `tessera health`, do not install it.
`health --metrics-addr` asks any service's HTTP /health on its metrics port instead of
gRPC (the same answer, whatever TLS the gRPC port speaks): the images' HEALTHCHECK.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tessera.common.flags import add_flag
from tessera.common.grpc_service import CHANNEL_OPTIONS

EXIT_RPC_ERROR = 1
EXIT_NOT_SERVING = 2
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tessera", description="tessera frontend client")
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="stream a completion for a prompt")
    gen.add_argument("prompt", help="the prompt (a user chat message unless --raw)")
    gen.add_argument("--max-tokens", type=int, default=None, help="tokens to generate at most")
    gen.add_argument("--temperature", type=float, default=None, help="0 for greedy")
    gen.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    gen.add_argument("--raw", action="store_true", help="send the prompt as plain text, not as chat")
    add_flag(gen, "--api-key", "TESSERA_API_KEY", None, secret=True,
             help="the frontend's API key (its --api-key; the first when comma-separated)")
    add_flag(gen, "--ca-file", "TESSERA_CLIENT_CA_FILE", None,
             help="PEM CA: reach the frontend over TLS, verifying its certificate")
    add_flag(gen, "--cert-file", "TESSERA_CLIENT_CERT_FILE", None,
             help="PEM certificate to present (mutual TLS; with --key-file)")
    add_flag(gen, "--key-file", "TESSERA_CLIENT_KEY_FILE", None, help="PEM private key of --cert-file")

    health = commands.add_parser("health", help="print the frontend's health status")
    health.add_argument("--metrics-addr", default=None, metavar="HOST:PORT",
                        help="ask a service's HTTP /health on its metrics port instead (any service, any TLS)")
    # (listed for --help; main() hands their whole command line to their own parsers)
    commands.add_parser("serve", add_help=False,
                        help="run the tokenizer, engine and frontend as local processes (tessera serve --help)")
    commands.add_parser("bench", add_help=False,
                        help="load generator for tessera or any OpenAI-compatible server (tessera bench --help)")
    for sub in (gen, health):
        add_flag(sub, "--addr", "TESSERA_FRONTEND_ADDR", "localhost:50051", help="frontend address")
        sub.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                         help="first wait up to this long for the frontend to be SERVING")
    return parser


def health_status(channel: grpc.Channel, timeout: float = 5.0) -> str:
    """The frontend's overall health status name (SERVING, NOT_SERVING, ...)."""
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def wait_serving(channel: grpc.Channel, seconds: float) -> str:
    """Poll health until SERVING or `seconds` pass; return the last status (or the last error)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            status = health_status(channel, timeout=2.0)
        except grpc.RpcError as exc:
            status = f"{exc.code().name}: {exc.details()}"
        if status == "SERVING" or time.monotonic() >= deadline:
            return status
        time.sleep(0.5)


def _prompt_args(args: argparse.Namespace) -> dict:
    sampling = {"max_tokens": args.max_tokens, "temperature": args.temperature, "seed": args.seed}
    prompt = {"prompt": args.prompt} if args.raw else {"messages": [{"role": "user", "content": args.prompt}]}
    return {**prompt, **{k: v for k, v in sampling.items() if v is not None}}


def cmd_generate(args: argparse.Namespace) -> int:
    try:  # the client only here: the service images do not install it
        from tessera.client import Client, TesseraError
    except ImportError as exc:
        print(f"tessera: generate needs the tessera-client package (pip install ./client): {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        client = Client(args.addr, api_key=args.api_key, ca_file=args.ca_file, cert_file=args.cert_file,
                        key_file=args.key_file)
    except ValueError as exc:
        print(f"tessera: generate: {exc}", file=sys.stderr)
        return EXIT_USAGE
    with client:
        if args.wait > 0:
            status = wait_serving(client.channel, args.wait)
            if status != "SERVING":
                print(f"tessera: frontend at {args.addr} not SERVING after {args.wait:g}s ({status})",
                      file=sys.stderr)
                return EXIT_NOT_SERVING
        stream = client.generate(**_prompt_args(args))
        last = None
        try:
            for delta in stream:
                if delta.text:
                    sys.stdout.write(delta.text)
                    sys.stdout.flush()
                if delta.finished or delta.usage is not None:
                    last = delta
        except KeyboardInterrupt:
            stream.cancel()
            print("\ninterrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
        except TesseraError as exc:
            print(f"tessera: generate failed: {exc} (frontend {args.addr})", file=sys.stderr)
            return EXIT_RPC_ERROR
    sys.stdout.write("\n")
    sys.stdout.flush()
    if last is not None:
        stop = f" stop_reason={last.stop_reason!r}" if last.stop_reason is not None else ""
        u = last.usage
        usage = (f" prompt_tokens={u.prompt_tokens} completion_tokens={u.completion_tokens} "
                 f"cached_prompt_tokens={u.cached_prompt_tokens}") if u is not None else ""
        print(f"[{last.request_id}] finish_reason={last.finish_reason}{stop}{usage}", file=sys.stderr)
    return 0


def cmd_health(args: argparse.Namespace, channel: grpc.Channel) -> int:
    status = health_status(channel)
    print(status)
    return 0 if status == "SERVING" else EXIT_NOT_SERVING


def http_health(metrics_addr: str, timeout: float = 5.0) -> int:
    """Exit status of `health --metrics-addr`: 0 when the service's HTTP /health says SERVING."""
    try:
        with urllib.request.urlopen(f"http://{metrics_addr}/health", timeout=timeout) as reply:
            status = json.loads(reply.read()).get("status", "UNKNOWN")
    except urllib.error.HTTPError as exc:  # 503: NOT_SERVING
        status = json.loads(exc.read() or b"{}").get("status", f"HTTP {exc.code}")
    except (OSError, ValueError) as exc:
        print(f"tessera: health at http://{metrics_addr}/health failed: {exc}", file=sys.stderr)
        return EXIT_RPC_ERROR
    print(status)
    return 0 if status == "SERVING" else EXIT_NOT_SERVING


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        from tessera import serve
        return serve.main(argv[1:])
    if argv[:1] == ["bench"]:
        from tessera.bench import cli as bench_cli
        return bench_cli.main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "health" and args.metrics_addr:
        return http_health(args.metrics_addr)
    if args.command == "generate":
        return cmd_generate(args)
    with grpc.insecure_channel(args.addr, options=CHANNEL_OPTIONS) as channel:
        if args.wait > 0:
            status = wait_serving(channel, args.wait)
            if status != "SERVING":
                print(f"tessera: frontend at {args.addr} not SERVING after {args.wait:g}s ({status})",
                      file=sys.stderr)
                return EXIT_NOT_SERVING
        try:
            return cmd_health(args, channel)
        except grpc.RpcError as exc:
            print(f"tessera: {args.command} failed: {exc.code().name}: {exc.details()} "
                  f"(frontend {args.addr})", file=sys.stderr)
            return EXIT_RPC_ERROR


if __name__ == "__main__":
    sys.exit(main())

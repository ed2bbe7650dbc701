"""`tessera bench`: the flags (named as `vllm bench serve` names them, so a vLLM user's command
line carries over) and the run: build the dataset, check one request, send the load, report.

    tessera bench --backend openai-chat --base-url http://127.0.0.1:8000 --num-prompts 200 \\
        --max-concurrency 16 --random-input-len 256 --random-output-len 64 --save-result
    tessera bench --backend grpc --addr 127.0.0.1:50051 --request-rate 4 --duration 60 ...
    tessera bench --backend openai-chat --endpoint /v1/chat/completions --dataset-name custom \\
        --dataset-path prompts.jsonl --custom-output-len 128 --request-rate 2 --request-timeout 60
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import sys

from tessera.bench import datasets, load, metrics, plots, report
from tessera.bench.backends import (BACKENDS, GrpcBackend, OpenAIBackend, RequestResult, default_endpoint,
                                    http_client, with_timeout)
from tessera.bench.vocab import GrpcVocabulary, HttpVocabulary, WordVocabulary
from tessera.common.flags import add_flag

EXIT_FAILED = 1


def _csv(kind):
    def parse(value: str) -> list:
        try:
            return [kind(v) for v in value.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {kind.__name__}s, got {value!r}") from None
    return parse


def _key_values(flag: str, items: list[str] | None) -> dict[str, str]:
    """["KEY=VALUE", ...] -> {KEY: VALUE}; ValueError naming the flag and a bad item."""
    out: dict[str, str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{flag}: expected KEY=VALUE, got {item!r}")
        out[key.strip()] = value
    return out


def _json_object(value: str) -> dict:
    try:
        body = json.loads(value)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc.msg} in {value!r}") from None
    if not isinstance(body, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {value!r}")
    return body


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tessera bench",
                                description="load generator for tessera or any OpenAI-compatible server")
    p.add_argument("--backend", choices=BACKENDS, default="openai",
                   help="openai-chat: /v1/chat/completions; openai: /v1/completions; grpc: tessera's "
                        "FrontendService.Generate")
    p.add_argument("--base-url", default=None,
                   help="server URL (default http://HOST:PORT); HTTP backends, and the vocabulary")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default=None,
                   help="the API path from the server's root, as vLLM's (default /v1/chat/completions with "
                        "openai-chat, /v1/completions with openai; a --base-url ending in /v1 loses it first)")
    p.add_argument("--header", nargs="+", default=None, metavar="KEY=VALUE",
                   help="HTTP headers added to every request (they replace the Authorization from OPENAI_API_KEY)")
    p.add_argument("--extra-body", type=_json_object, default=None, metavar="JSON",
                   help='a JSON object merged into every request body last, e.g. \'{"temperature": 0.7}\'')
    p.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                   help="cancel a request still running after this many seconds and count it as failed "
                        "(default: none; vLLM's bench serve gives each request 6 hours)")
    add_flag(p, "--addr", "TESSERA_FRONTEND_ADDR", "localhost:50051", help="frontend gRPC address (--backend grpc)")
    p.add_argument("--tokenizer-addr", default=None,
                   help="build prompts with tessera's tokenizer gRPC service here instead of the server's "
                        "HTTP /tokenize and /detokenize (which --backend grpc also uses without this)")
    p.add_argument("--model", default=None, help="model name to ask for (default: the server's first in /v1/models)")
    p.add_argument("--num-prompts", type=int, default=1000, help="requests to send (with --duration: dataset size)")
    p.add_argument("--duration", type=float, default=None,
                   help="send for this many seconds instead of --num-prompts requests (the prompts cycle)")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="mean requests per second (inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the gaps between requests: 1 Poisson, < 1 burstier, > 1 more even, "
                        "inf evenly spaced (the gaps are vLLM's for the same --seed, scaled as vLLM scales them "
                        "to end at num_prompts / rate)")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    p.add_argument("--dataset-name", choices=["random", "sharegpt", "prefix", "custom"], default="random")
    p.add_argument("--dataset-path", default=None,
                   help="ShareGPT JSON file (--dataset-name sharegpt); JSONL file, one {\"prompt\": ..., "
                        "\"output_tokens\": N (optional)} per line (--dataset-name custom, vLLM's format)")
    p.add_argument("--custom-output-len", type=int, default=256,
                   help="max tokens of every custom request; -1: each line's output_tokens (--dataset-name custom)")
    p.add_argument("--skip-chat-template", action="store_true",
                   help="accepted for vLLM's command lines; tessera bench always sends custom prompts as they "
                        "are (the chat backend as the user message, templated by the server), which is what "
                        "this flag makes vLLM do")
    p.add_argument("--disable-shuffle", action="store_true",
                   help="custom prompts in the file's order (default: shuffled by --seed, as vLLM)")
    p.add_argument("--no-oversample", action="store_true",
                   help="fewer custom prompts than --num-prompts: send those only (default: repeat random ones)")
    p.add_argument("--random-input-len", type=int, default=1024, help="prompt tokens (random, prefix)")
    p.add_argument("--random-output-len", type=int, default=128, help="max tokens to generate (random, prefix)")
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)]")
    p.add_argument("--prefix-len", "--random-prefix-len", type=int, default=256,
                   help="tokens of the system prompt every request shares (--dataset-name prefix)")
    p.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="max tokens for every ShareGPT request (default: the recorded answer's length)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true", help="generate max tokens whatever the model says")
    p.add_argument("--num-warmups", type=int, default=0,
                   help="requests (copies of the first prompt) sent before the run and not counted")
    p.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:100 (ms; names ttft, tpot, e2el)")
    p.add_argument("--percentile-metrics", type=_csv(str), default=list(metrics.LATENCY_METRICS),
                   help="comma-separated, of ttft,tpot,itl,e2el")
    p.add_argument("--metric-percentiles", type=_csv(float), default=[50.0, 90.0, 99.0],
                   help="comma-separated percentiles, e.g. 50,90,99")
    p.add_argument("--save-result", action="store_true", help="save the result as JSON")
    p.add_argument("--result-dir", default=None, help="where the JSON goes (default: here)")
    p.add_argument("--result-filename", default=None, help="JSON file name (default: from the settings and time)")
    p.add_argument("--metadata", nargs="+", default=None, metavar="KEY=VALUE",
                   help="recorded in the saved result, e.g. --metadata server=tessera round=1")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    sweep = p.add_mutually_exclusive_group()
    sweep.add_argument("--sweep-max-concurrency", type=_csv(int), default=None, metavar="N,N,...",
                       help="one run per max concurrency (e.g. 1,4,16,64), then PNG charts in --result-dir")
    sweep.add_argument("--sweep-request-rate", type=_csv(float), default=None, metavar="R,R,...",
                       help="one run per request rate (e.g. 1,2,4), then PNG charts in --result-dir")
    sweep.add_argument("--plot", nargs="+", default=None, metavar="SWEEP.json",
                       help="send nothing: draw these saved sweeps (ours, vLLM's, ...) on one chart")
    p.add_argument("--label", default=None, help="this run's name on the charts (default: backend and model)")
    return p


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors (exit 2) that name the option."""
    positive = {"--num-prompts": args.num_prompts, "--request-rate": args.request_rate,
                "--burstiness": args.burstiness, "--random-input-len": args.random_input_len,
                "--random-output-len": args.random_output_len}
    if args.max_concurrency is not None:
        positive["--max-concurrency"] = args.max_concurrency
    if args.duration is not None:
        positive["--duration"] = args.duration
    for flag, value in positive.items():
        if not value > 0:
            parser.error(f"{flag} must be > 0, got {value}")
    if not 0 <= args.random_range_ratio < 1:
        parser.error(f"--random-range-ratio must be in [0, 1), got {args.random_range_ratio}")
    if args.prefix_len < 0:
        parser.error(f"--prefix-len must be >= 0, got {args.prefix_len}")
    if args.dataset_name in ("sharegpt", "custom") and not args.dataset_path:
        parser.error(f"--dataset-path is required with --dataset-name {args.dataset_name}")
    if args.dataset_name == "custom" and not args.dataset_path.endswith(".jsonl"):
        parser.error(f"--dataset-path: a custom dataset is a .jsonl file, got {args.dataset_path!r}")
    if not (args.custom_output_len > 0 or args.custom_output_len == -1):
        parser.error(f"--custom-output-len must be > 0, or -1 for each line's output_tokens, "
                     f"got {args.custom_output_len}")
    if args.request_timeout is not None and not args.request_timeout > 0:
        parser.error(f"--request-timeout must be > 0 seconds, got {args.request_timeout}")
    if args.num_warmups < 0:
        parser.error(f"--num-warmups must be >= 0, got {args.num_warmups}")
    if args.endpoint is not None and not args.endpoint.startswith("/"):
        parser.error(f"--endpoint is a path starting with /, got {args.endpoint!r}")
    if args.backend == "grpc":
        for flag, value in (("--endpoint", args.endpoint), ("--header", args.header),
                            ("--extra-body", args.extra_body)):
            if value is not None:
                parser.error(f"{flag} is for the HTTP backends (openai-chat, openai), not --backend grpc")
    try:
        args.headers = _key_values("--header", args.header)
        args.metadata_dict = _key_values("--metadata", args.metadata)
    except ValueError as exc:
        parser.error(str(exc))
    if args.duration and math.isinf(args.request_rate) and not args.max_concurrency:
        parser.error("--duration needs --max-concurrency or a finite --request-rate (else it floods the server)")
    bad = [m for m in args.percentile_metrics if m not in metrics.LATENCY_METRICS]
    if bad or not args.percentile_metrics:
        parser.error(f"--percentile-metrics: {','.join(bad) or 'none given'}; choose from "
                     f"{','.join(metrics.LATENCY_METRICS)}")
    if not args.metric_percentiles or not all(0 < p <= 100 for p in args.metric_percentiles):
        parser.error(f"--metric-percentiles must be in (0, 100], got {args.metric_percentiles}")
    for flag, values in (("--sweep-max-concurrency", args.sweep_max_concurrency),
                         ("--sweep-request-rate", args.sweep_request_rate)):
        if values is not None and (not values or not all(v > 0 for v in values)):
            parser.error(f"{flag} needs values > 0, got {values}")
    try:
        args.slos = metrics.parse_goodput(args.goodput or [])
    except ValueError as exc:
        parser.error(f"--goodput: {exc}")
    args.base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    if args.base_url.endswith("/v1"):  # a client's base URL: the paths below add /v1 themselves
        args.base_url = args.base_url[:-3]


async def served_model(client, base_url: str) -> str:
    reply = await client.get(f"{base_url}/v1/models")
    reply.raise_for_status()
    return reply.json()["data"][0]["id"]


async def has_tokenize(vocab: HttpVocabulary) -> bool:
    import httpx2
    try:
        await vocab.tokenize("hello")
    except httpx2.HTTPStatusError as exc:
        if exc.response.status_code in (404, 405):
            return False
        raise
    return True


async def build_dataset(args: argparse.Namespace, vocab) -> list[datasets.SampleRequest]:
    if args.dataset_name == "sharegpt":
        return await datasets.sharegpt_requests(vocab, args.dataset_path, args.num_prompts, args.seed,
                                                args.sharegpt_output_len)
    if args.dataset_name == "custom":
        return await datasets.custom_requests(vocab, args.dataset_path, args.num_prompts, args.seed,
                                              args.custom_output_len, shuffle=not args.disable_shuffle,
                                              oversample=not args.no_oversample)
    prefix = args.prefix_len if args.dataset_name == "prefix" else 0
    return await datasets.random_requests(vocab, args.num_prompts, args.random_input_len, args.random_output_len,
                                          args.random_range_ratio, args.seed, prefix)


async def bench(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    most = max(args.sweep_max_concurrency or [args.max_concurrency or 1000])
    async with http_client(most) as client:
        if args.model is None and args.backend != "grpc":
            args.model = await served_model(client, args.base_url)
        grpc_backend = GrpcBackend(args.addr, args.ignore_eos) if args.backend == "grpc" else None
        vocab = (GrpcVocabulary(args.tokenizer_addr) if args.tokenizer_addr
                 else HttpVocabulary(client, args.base_url, args.model))
        try:
            if isinstance(vocab, HttpVocabulary) and not await has_tokenize(vocab):
                print("the server has no /tokenize: prompt lengths are counted in words", file=sys.stderr)
                vocab = WordVocabulary()
            print(f"building {args.dataset_name} prompts", file=sys.stderr)
            samples = await build_dataset(args, vocab)
            send = with_timeout(grpc_backend or OpenAIBackend(
                client, args.base_url, args.model, args.backend == "openai-chat", args.ignore_eos,
                endpoint=args.endpoint, headers=args.headers, extra_body=args.extra_body), args.request_timeout)
            # one request first: a wrong URL or model fails here, not as N failed requests
            first = await send(samples[0])
            if not first.success:
                print(f"tessera bench: the test request failed: {first.error}", file=sys.stderr)
                return EXIT_FAILED
            if args.num_warmups:
                print(f"warming up with {args.num_warmups} requests", file=sys.stderr)
                await load.run_load(send, [samples[0]] * args.num_warmups, num_prompts=args.num_warmups,
                                    duration=None, request_rate=math.inf, burstiness=1.0,
                                    max_concurrency=args.max_concurrency, seed=args.seed)
            code, runs = 0, []
            for setting in settings(args):
                vars(args).update(setting)
                print(f"sending: backend={args.backend} request_rate={args.request_rate} "
                      f"burstiness={args.burstiness} max_concurrency={args.max_concurrency} "
                      + (f"duration={args.duration}s" if args.duration else f"num_prompts={args.num_prompts}"),
                      file=sys.stderr)
                bar = tqdm(total=None if args.duration else min(args.num_prompts, len(samples)), file=sys.stderr,
                           disable=args.disable_tqdm, unit="req")
                results, duration = await load.run_load(
                    send, samples, num_prompts=args.num_prompts, duration=args.duration,
                    request_rate=args.request_rate, burstiness=args.burstiness,
                    max_concurrency=args.max_concurrency, seed=args.seed, on_done=lambda r: bar.update(1))
                bar.close()
                figures, run_code = finish(args, results, duration)
                runs.append(figures)
                code = code or run_code
        finally:
            await vocab.close()
            if grpc_backend is not None:
                await grpc_backend.close()
    if args.sweep_max_concurrency or args.sweep_request_rate:
        save_sweep(args, runs)
    return code


def settings(args: argparse.Namespace) -> list[dict]:
    """The runs of a sweep (one run without one)."""
    if args.sweep_max_concurrency:
        return [{"max_concurrency": c} for c in args.sweep_max_concurrency]
    if args.sweep_request_rate:
        return [{"request_rate": r} for r in args.sweep_request_rate]
    return [{}]


def save_sweep(args: argparse.Namespace, runs: list[dict]) -> None:
    """The sweep's figures as one JSON file and its charts, in --result-dir."""
    axis = "max_concurrency" if args.sweep_max_concurrency else "request_rate"
    label = args.label or f"{args.backend} {(args.model or 'tessera').rstrip('/').split('/')[-1]}"
    sweep = {"label": label, "sweep": axis, "runs": runs}
    path = report.save(sweep, args.result_dir, f"sweep-{axis}-{datetime.datetime.now():%Y%m%d-%H%M%S}.json")
    print(f"sweep saved to {path}", file=sys.stderr)
    for chart in plots.draw([sweep], args.result_dir or ".", prefix=f"sweep-{axis}"):
        print(f"chart saved to {chart}", file=sys.stderr)


def plot_only(args: argparse.Namespace) -> int:
    """--plot: draw saved sweeps on one chart (labels: each file's, or --label a,b,...)."""
    sweeps = [plots.load_sweep(path) for path in args.plot]
    if args.label:
        for sweep, label in zip(sweeps, args.label.split(",")):
            sweep["label"] = label
    if len({s["sweep"] for s in sweeps}) > 1:
        raise ValueError("--plot: the files sweep different settings (max concurrency and request rate)")
    for chart in plots.draw(sweeps, args.result_dir or ".", prefix=f"compare-{sweeps[0]['sweep']}"):
        print(f"chart saved to {chart}", file=sys.stderr)
    return 0


def finish(args: argparse.Namespace, results: list[RequestResult], duration: float) -> tuple[dict, int]:
    """Print (and with --save-result save) one run's result; its figures and exit status."""
    figures = metrics.compute(results, duration, args.metric_percentiles, args.percentile_metrics, args.slos)
    figures["max_concurrency"] = args.max_concurrency
    figures["request_rate"] = "inf" if math.isinf(args.request_rate) else args.request_rate
    report.print_table(figures, args.percentile_metrics, args.metric_percentiles, sys.stdout)
    failures = [r.error for r in results if not r.success]
    if failures:
        print(f"{len(failures)} requests failed; the first: {failures[0]}", file=sys.stderr)
    if args.save_result:
        now = datetime.datetime.now()
        result = {
            "date": now.strftime("%Y%m%d-%H%M%S"), "backend": args.backend, "model_id": args.model,
            "base_url": args.base_url if args.backend != "grpc" else None,
            "addr": args.addr if args.backend == "grpc" else None,
            "endpoint": (None if args.backend == "grpc"
                         else args.endpoint or default_endpoint(args.backend == "openai-chat")),
            "dataset_name": args.dataset_name, "dataset_path": args.dataset_path, "num_prompts": args.num_prompts,
            "duration_limit": args.duration, "burstiness": args.burstiness, "seed": args.seed,
            "request_timeout": args.request_timeout, **args.metadata_dict,
            **figures, **metrics.per_request(results),
        }
        rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}"
        model = (args.model or "tessera").rstrip("/").split("/")[-1]
        default = f"{args.backend}-{rate}qps-concurrency{args.max_concurrency}-{model}-{result['date']}.json"
        name = (args.result_filename if len(settings(args)) == 1 else None) or default
        path = report.save(result, args.result_dir, name)
        print(f"result saved to {path}", file=sys.stderr)
    return figures, 0 if figures["completed"] else EXIT_FAILED


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check(parser, args)
    try:
        if args.plot:
            return plot_only(args)
        return asyncio.run(bench(args))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a server that cannot be reached: one line, not a traceback
        print(f"tessera bench: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())

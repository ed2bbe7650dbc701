"""`tessera serve`: the three services as local processes, one command.

    tessera serve [--model PATH] [--port 50051] [--http-port 8000] [any service flag ...]

Starts `python -m tessera_tokenizer`, `python -m tessera_engine` and `python -m
tessera_frontend` (what the images run), waits until the frontend is SERVING, prints its
gRPC and HTTP endpoints, and on Ctrl-C / SIGTERM stops them with their drain: the frontend
first (in-flight requests finish), then the tokenizer and the engine.

A flag serve does not know goes to every service that has it (`--max-num-seqs 8` to the
engine, `--log-level DEBUG` to all three); one no service has is a usage error.

What a person sees on a terminal: a progress bar while the model loads, then the endpoints;
the services' logs go to a file (text lines; `--log-format json` for JSON), and their
warnings show as one line each. When a service exits (a model that can never be served ends
the engine with the reason in its log), serve prints that reason, naming the model, and the
last lines of that service's log, stops the others and exits 1, without waiting out
--startup-timeout-s. When stdout is no terminal the services' log lines pass through on
stderr (JSON, or text with `--log-format text`) and serve's own lines are JSON (or text)
on stdout. The services always log JSON to serve, which reads them.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import pathlib
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from tessera import launch
from tessera.common import logs
from tessera.common.flags import DEFAULT_DRAIN_TIMEOUT_S
from tessera.launch import SERVICE_MODULES

DEFAULT_PORTS = {"tokenizer": 50052, "engine": 50053, "frontend": 50051}
DEFAULT_METRICS_PORTS = {"tokenizer": 9302, "engine": 9303, "frontend": 9301}
# Log lines (service, msg) that mark a step of loading, in their usual order: the progress bar.
LOAD_STEPS = [("tokenizer", "tokenizer loaded"), ("engine", "backend plan"), ("engine", "kv cache allocated"),
              ("engine", "warmed up"), ("engine", "engine ready"), ("frontend", "health changed")]
EXIT_FAILED = 1
TAIL_LINES = 50    # a child's last log lines kept in memory (its failure's reason is among them)
SHOWN_TAIL = 10    # those printed when it fails


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tessera serve", description="run the tokenizer, engine and frontend as local processes",
        epilog="Any other flag of tessera-tokenizer, tessera-engine or tessera-frontend is passed to the "
               "services that take it (see `python -m tessera_engine --help`).")
    # The services read the same environment variables for these (TESSERA_MODEL, ...): the
    # children inherit the environment, so serve only passes what was given on its command line.
    p.add_argument("--model", default=None, help="HF model directory or .gguf file (tokenizer and engine)")
    p.add_argument("--port", type=int, default=int(os.environ.get("TESSERA_FRONTEND_PORT", DEFAULT_PORTS["frontend"])),
                   help="frontend gRPC port [env TESSERA_FRONTEND_PORT]")
    p.add_argument("--tokenizer-port", type=int,
                   default=int(os.environ.get("TESSERA_TOKENIZER_PORT", DEFAULT_PORTS["tokenizer"])),
                   help="tokenizer gRPC port [env TESSERA_TOKENIZER_PORT]")
    p.add_argument("--engine-port", type=int,
                   default=int(os.environ.get("TESSERA_ENGINE_PORT", DEFAULT_PORTS["engine"])),
                   help="engine gRPC port [env TESSERA_ENGINE_PORT]")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="frontend metrics port (0: every service without metrics); the tokenizer and engine "
                        "take --tokenizer-metrics-port and --engine-metrics-port")
    p.add_argument("--tokenizer-metrics-port", type=int, default=None)
    p.add_argument("--engine-metrics-port", type=int, default=None)
    p.add_argument("--startup-timeout-s", type=float, default=600.0,
                   help="give up when the frontend is not SERVING after this long")
    p.add_argument("--log-dir", default=None,
                   help="on a terminal: where the services' logs go (default: a new temporary directory)")
    p.add_argument("--log-format", type=logs.log_format, choices=list(logs.LOG_FORMATS),
                   default=os.environ.get("TESSERA_LOG_FORMAT") or "auto",
                   help="the services' log lines as serve writes them (the log file on a terminal, else stderr) "
                        "and serve's own lines when stdout is no terminal: json or text; auto: text in the file "
                        "on a terminal, JSON otherwise [env TESSERA_LOG_FORMAT]")
    return p


def option_names(module: str) -> set[str]:
    """Every option string of a service's command line, read from its own parser (not a copy)."""
    server = importlib.import_module(f"{module}.server")
    if hasattr(server, "build_parser"):
        parser = server.build_parser()
    else:  # parse_args(argv) builds and parses at once: catch the parser at its parse
        class _Caught(Exception):
            pass

        caught: list[argparse.ArgumentParser] = []
        original = argparse.ArgumentParser.parse_args

        def catch(self, *a, **k):
            caught.append(self)
            raise _Caught

        argparse.ArgumentParser.parse_args = catch  # type: ignore[method-assign]
        try:
            server.parse_args([])
        except _Caught:
            pass
        finally:
            argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]
        parser = caught[0]
    return {s for action in parser._actions for s in action.option_strings}


def split_flags(extra: list[str]) -> list[list[str]]:
    """Group `--flag value ...` tokens: each group a flag and the values after it."""
    groups: list[list[str]] = []
    for token in extra:
        if token.startswith("--"):
            groups.append([token])
        elif groups and not (token.startswith("-") and not _is_number(token)):
            groups[-1].append(token)
        else:
            raise ValueError(token)
    return groups


def _is_number(token: str) -> bool:
    try:
        float(token)
        return True
    except ValueError:
        return False


def route_flags(parser: argparse.ArgumentParser, extra: list[str]) -> dict[str, list[str]]:
    """The extra flags of each service; a flag none of them has is a usage error (exit 2)."""
    routed: dict[str, list[str]] = {name: [] for name in SERVICE_MODULES}
    if not extra:
        return routed
    try:
        groups = split_flags(extra)
    except ValueError as exc:
        parser.error(f"unrecognized arguments: {exc}")
    options = {name: option_names(module) for name, module in SERVICE_MODULES.items()}
    for group in groups:
        flag = group[0].split("=", 1)[0]
        takers = [name for name in SERVICE_MODULES if flag in options[name]]
        if not takers:
            parser.error(f"unrecognized arguments: {flag} (no service takes it)")
        for name in takers:
            routed[name] += group
    return routed


@dataclass
class Child(launch.Service):
    """A service as serve runs it (tessera.launch: own session, SIGTERM when serve dies, stderr
    piped): with the thread that reads its log lines and their last ones (JSON, as read)."""
    reader: threading.Thread | None = None
    tail: list[str] = field(default_factory=list)

    def exit_report(self) -> tuple[str, str | None, list[str]]:
        """Once it has exited: what happened, why (its log's last error, None when it says
        nothing), and its last log lines as text (tracebacks cut to their last line)."""
        if self.reader is not None:
            self.reader.join(timeout=2)  # the pipe's last lines (the reason) are read by then
        what = f"{self.name} exited with status {self.process.returncode}"
        shown = [logs.json_to_text(line, traceback=False) for line in self.tail[-SHOWN_TAIL:]]
        return what, logs.failure_reason(self.tail), shown


class Progress:
    """What serve shows: on a terminal a progress bar built from the services' log lines while
    the model loads, their warnings as one line each, everything else in the log file (in
    `log_format`); elsewhere their lines as they come, on stderr."""

    def __init__(self, tty: bool, log_file, log_format: str = "json") -> None:
        self.tty, self.log_file, self.log_format = tty, log_file, log_format
        self.seen: set[tuple[str, str]] = set()
        self.lock = threading.Lock()
        self.bar = None
        if tty:
            try:
                from tqdm import tqdm
                # a terminal that reports no size (0 x 0, e.g. under `script`) would hide the bar
                size = shutil.get_terminal_size((100, 24))
                self.bar = tqdm(total=len(LOAD_STEPS), desc="loading ", unit="step", file=sys.stderr,
                                ncols=min(size.columns or 100, 100), nrows=size.lines or 24,
                                bar_format="{desc}{bar} {n_fmt}/{total_fmt} [{elapsed}]")
            except ImportError:  # tqdm is optional: plain lines then
                self.bar = None

    def _as_written(self, text: str) -> str:
        line = logs.json_to_text(text) if self.log_format == "text" else text.rstrip("\n")
        return line + "\n"

    def line(self, service: str, text: str) -> None:
        with self.lock:
            if not self.tty:
                sys.stderr.write(self._as_written(text))
                sys.stderr.flush()
                return
            self.log_file.write(self._as_written(text))
            self.log_file.flush()
            record = logs.parse_line(text)
            if record is None:
                return
            step = (service, record.get("msg", ""))
            if step == ("frontend", "health changed") and not record.get("serving"):
                step = ("frontend", "not serving yet")  # its first health line says NOT_SERVING
            if step in LOAD_STEPS and step not in self.seen:
                self.seen.add(step)
                if self.bar is not None:
                    self.bar.set_description_str(f"loading: {service} {step[1]} ", refresh=False)
                    self.bar.update(1)
            if record.get("level") == "WARNING":
                # errors are not shown one by one: a service that fails is reported with its reason
                self._print(logs.record_text(record, traceback=False), sys.stderr)

    def _print(self, text: str, stream) -> None:
        if self.bar is not None:
            self.bar.write(text, file=stream)
        else:
            print(text, file=stream, flush=True)

    def say(self, msg: str, level: str = "INFO", **fields) -> None:
        """serve's own line: on a terminal text (above the bar; to stderr when it is an error),
        else a log line on stdout (JSON, or text with --log-format text)."""
        with self.lock:
            if self.tty:
                text = msg + "".join(f"  {k}={v}" for k, v in fields.items())
                self._print(text, sys.stderr if level == "ERROR" else sys.stdout)
                return
            ts = round(time.time(), 6)
            if self.log_format == "json":
                print(json.dumps({"ts": ts, "level": level, "service": "serve", "msg": msg, **fields}), flush=True)
                return
            # text: a field of several lines (a log tail) goes on the lines after
            long = {k: v for k, v in fields.items() if isinstance(v, str) and "\n" in v}
            short = {k: v for k, v in fields.items() if k not in long}
            after = "\n".join(f"{k}:\n{v}" for k, v in long.items())
            print(logs.text_line(ts, level, "serve", msg, short, exc=after or None), flush=True)

    def note(self, msg: str, **fields) -> None:
        """A line for the log file only on a terminal (what serve does, not worth showing); said elsewhere."""
        if not self.tty:
            self.say(msg, **fields)
            return
        with self.lock:
            record = {"ts": round(time.time(), 6), "level": "INFO", "service": "serve", "msg": msg, **fields}
            self.log_file.write(self._as_written(json.dumps(record)))
            self.log_file.flush()

    def failed(self, child: Child, when: str) -> None:
        """A child has exited `when` (e.g. "before the stack was SERVING"): what, why, its last lines."""
        what, reason, shown = child.exit_report()
        if not self.tty:
            self.say(f"{what} {when}", level="ERROR", failed=child.name,
                     exit_code=child.process.returncode, reason=reason, tail="\n".join(shown))
            return
        self.close(complete=False)
        lines = [f"{what} {when}" + (f": {reason}" if reason else ""),
                 f"last lines of its log ({self.log_file.name}):", *("  " + line for line in shown)]
        self.say("\n".join(lines), level="ERROR")

    def close(self, complete: bool = True) -> None:
        """The bar gone (filled first when the stack came up)."""
        with self.lock:
            if self.bar is not None:
                if complete:
                    self.bar.update(len(LOAD_STEPS) - self.bar.n)
                self.bar.close()
                self.bar = None


def _flag_value(args: list[str], flag: str) -> str | None:
    """The value given to `flag` in a service's routed args, if any."""
    for i, token in enumerate(args):
        if token == flag and i + 1 < len(args):
            return args[i + 1]
        if token.startswith(flag + "="):
            return token.split("=", 1)[1]
    return None


def plan(args: argparse.Namespace, routed: dict[str, list[str]]) -> list[Child]:
    """The three children's flags and environments, in start order."""
    ports = {"tokenizer": args.tokenizer_port, "engine": args.engine_port, "frontend": args.port}
    metrics = {"tokenizer": args.tokenizer_metrics_port, "engine": args.engine_metrics_port,
               "frontend": args.metrics_port}
    children = []
    for name in SERVICE_MODULES:
        extra = list(routed[name])
        if args.model and name in ("tokenizer", "engine"):
            extra = ["--model", args.model, *extra]
        if name == "frontend":
            for flag, backend in (("--tokenizer-addr", children[0]), ("--engine-addrs", children[1])):
                if _flag_value(extra, flag) is None:
                    extra += [flag, f"{_connect_host(backend)}:{backend.port}"]
        # one TESSERA_METRICS_PORT for all three would collide: each gets its own
        port = metrics[name]
        if port is None and (args.metrics_port == 0 or os.environ.get("TESSERA_METRICS_PORT") == "0"):
            port = 0  # off for one: off for all
        # the children inherit serve's environment (TESSERA_BIND_HOST included): nothing is bound for them
        child = Child(name, SERVICE_MODULES[name], ports[name], extra, None, bind_host=False,
                      metrics_port=DEFAULT_METRICS_PORTS[name] if port is None else port)
        child.host = _connect_host(child)
        children.append(child)
    return children


class Stopping(Exception):
    """SIGTERM (or SIGINT) arrived."""


def _connect_host(child: Child) -> str:
    """Where serve reaches a child: its bind address, loopback for a wildcard one."""
    host = _flag_value(child.args, "--host") or child.environment().get("TESSERA_BIND_HOST") or "0.0.0.0"
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def run(args: argparse.Namespace, routed: dict[str, list[str]],
        on_serving: Callable[[str], None] | None = None) -> int:
    """Run the stack until a signal (0 when all three drained and exited 0) or a child's exit (1,
    its reason printed); `on_serving(grpc_addr)` runs once it is SERVING (`make run` asks a
    sample question there)."""
    tty = sys.stdout.isatty()
    children = plan(args, routed)
    log_dir = pathlib.Path(args.log_dir or tempfile.mkdtemp(prefix="tessera-serve-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log_file = open(log_dir / "services.log", "a", encoding="utf-8") if tty else None
    # auto: text for the person on a terminal (who reads the file), JSON for whatever reads a pipe
    log_format = args.log_format if args.log_format != "auto" else "text" if tty else "json"
    progress = Progress(tty, log_file, log_format)
    stop_signals: list[int] = []

    def on_signal(signum, frame):
        # Only the first signal stops: `make run` under Ctrl-C or `timeout` gets two at once,
        # and a handler re-entered inside a lock it holds (threading.Event.set) waited forever.
        if stop_signals:
            return
        stop_signals.append(signum)
        raise Stopping

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    frontend = children[-1]
    http_port = _flag_value(frontend.args, "--http-port") or os.environ.get("TESSERA_HTTP_PORT") or "8000"
    code = 0
    try:
        if tty:
            progress.say(f"service logs: {log_dir / 'services.log'}")
        for child in children:
            progress.note(f"starting {child.name}", port=child.port,
                          command=f"python -m {SERVICE_MODULES[child.name]}")
            # own session: a terminal's Ctrl-C reaches serve only, which stops them in order
            child.start()
            child.reader = threading.Thread(target=_pump, args=(child, progress), daemon=True,
                                            name=f"log-{child.name}")
            child.reader.start()
        deadline = time.monotonic() + args.startup_timeout_s
        host = frontend.host
        addr = frontend.addr
        while not launch.is_serving(addr):
            # a service that exits while loading (a model that can never be served ends the
            # engine) fails the start now, with its reason, not at the startup timeout
            if _report_exits(children, progress, "before the stack was SERVING"):
                return EXIT_FAILED
            if time.monotonic() > deadline:
                progress.close(complete=False)
                progress.say(f"the frontend is not SERVING after {args.startup_timeout_s:g}s", level="ERROR")
                return EXIT_FAILED
            time.sleep(0.25)
        progress.close()
        http = f"http://{host}:{http_port}/v1" if http_port != "0" else "off"
        progress.say("serving", grpc=addr, http=http)
        if tty:
            print(f"try: tessera generate 'Why is the sky blue?' --addr {addr}\nCtrl-C stops all three", flush=True)
        if on_serving is not None:
            on_serving(addr)
        while not _report_exits(children, progress, "while serving"):
            time.sleep(0.5)
        code = EXIT_FAILED
    except Stopping:
        pass
    finally:
        # no second signal may break off the drain below
        for s in previous:
            signal.signal(s, signal.SIG_IGN)
        progress.close()
        progress.say("stopping (frontend first, then the tokenizer and the engine)")
        failed = stop_all(children, args)
        if failed and stop_signals:
            code = EXIT_FAILED
        for s, handler in previous.items():
            signal.signal(s, handler)
        for child in children:
            if child.reader is not None:
                child.reader.join(timeout=2)
        if log_file is not None:
            log_file.close()
    progress.say("stopped", exit_code=code)
    return code


def _report_exits(children: list[Child], progress: Progress, when: str) -> bool:
    """Whether a child has exited; each that has is reported (what, why, its last lines)."""
    dead = [c for c in children if c.process.poll() is not None]
    for child in dead:
        progress.failed(child, when)
    return bool(dead)


def stop_all(children: list[Child], args: argparse.Namespace) -> list[str]:
    """SIGTERM the frontend and wait for its drain, then the others; the names of those that
    did not exit 0 (a child still up after its drain and a margin is killed)."""
    drain = float(os.environ.get("TESSERA_DRAIN_TIMEOUT_S") or DEFAULT_DRAIN_TIMEOUT_S)
    for child in children:
        value = _flag_value(child.args, "--drain-timeout-s") or _flag_value(child.args, "--shutdown-grace-s")
        if value:
            drain = max(drain, float(value))
    frontend, backends = children[-1], children[:-1]
    failed: list[str] = []
    for group in ([frontend], backends):
        launch.terminate([c.process for c in group if c.running()], timeout=drain + 15)
        for child in group:
            if child.process is not None and child.process.returncode not in (0, None):
                failed.append(child.name)
    return failed


def _pump(child: Child, progress: Progress) -> None:
    """Read a child's log lines until it closes stderr."""
    assert child.process is not None and child.process.stderr is not None
    for text in child.process.stderr:
        child.tail = (child.tail + [text])[-TAIL_LINES:]
        progress.line(child.name, text)


def main(argv: list[str] | None = None, on_serving: Callable[[str], None] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    routed = route_flags(parser, extra)
    return run(args, routed, on_serving)


if __name__ == "__main__":
    sys.exit(main())

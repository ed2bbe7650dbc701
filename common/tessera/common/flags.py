"""Command-line flags with environment-variable fallbacks.

Every flag `--foo-bar` of service `svc` also reads `TESSERA_FOO_BAR` (the env
name is given explicitly so compose, k8s and the README share one spelling).
Precedence: command line > environment > default.
"""
from __future__ import annotations

import argparse
import os
from typing import Any, Callable

from tessera.common import aio
from tessera.common.logs import LOG_FORMATS, log_format

# Seconds in-flight requests get to finish on SIGTERM/SIGINT (--drain-timeout-s). Compose's
# stop_grace_period and k8s' terminationGracePeriodSeconds (with the preStop sleep) exceed it.
DEFAULT_DRAIN_TIMEOUT_S = 30.0


def _parse_bool(value: str) -> bool:
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {value!r}")


def add_flag(
    parser: argparse.ArgumentParser,
    flag: str,
    env: str,
    default: Any = None,
    type: Callable[[str], Any] = str,
    help: str = "",
    choices: list[Any] | None = None,
    aliases: tuple[str, ...] = (),
    secret: bool = False,
) -> None:
    """Add `flag` (also spelled as each of `aliases`) whose default comes from environment
    variable `env` when set; a `secret` one's value is never shown in --help."""
    if type is bool:
        type = _parse_bool
    raw = os.environ.get(env)
    if raw is not None and raw != "":
        try:
            default = type(raw)
        except (ValueError, argparse.ArgumentTypeError) as exc:
            parser.error(f"environment variable {env}={raw!r} is invalid: {exc}")
    boolean = type is _parse_bool
    parser.add_argument(
        flag,
        *aliases,
        default=default,
        type=type,
        choices=choices,
        # a boolean flag alone means true (vLLM's `--enforce-eager`), and `--no-<flag>` false
        **({"nargs": "?", "const": True} if boolean else {}),
        help=f"{help} [env {env}; " + ("a secret: never shown]" if secret else f"default {default!r}]")
        + (f"; {flag} alone: true, --no-{flag[2:]}: false" if boolean else ""),
    )
    if boolean:
        parser.add_argument(f"--no-{flag[2:]}", dest=flag[2:].replace("-", "_"), action="store_const", const=False,
                            help=argparse.SUPPRESS)


def _non_negative_seconds(value: str) -> float:
    seconds = float(value)
    if not seconds >= 0:  # (also refuses nan)
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {value!r}")
    return seconds


def add_common_flags(parser: argparse.ArgumentParser, default_port: int, port_env: str) -> None:
    """Flags every service has: bind host, port, log level, event loop, drain timeout."""
    add_flag(parser, "--host", "TESSERA_BIND_HOST", "0.0.0.0", help="address to bind")
    add_flag(parser, "--port", port_env, default_port, type=int, help="gRPC port")
    add_flag(parser, "--log-level", "TESSERA_LOG_LEVEL", "INFO", help="log level",
             choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    add_flag(parser, "--log-format", "TESSERA_LOG_FORMAT", "auto", type=log_format, choices=list(LOG_FORMATS),
             help="log lines as JSON or as text (time, level, service, [request id], message, key=value "
                  "fields); auto: text when stderr is a terminal, else JSON")
    add_flag(parser, "--event-loop", "TESSERA_EVENT_LOOP", "auto", choices=aio.EVENT_LOOPS,
             help="asyncio event loop: uvloop (less CPU per gRPC message) or the standard one; auto = uvloop if installed")
    add_flag(parser, "--drain-timeout-s", "TESSERA_DRAIN_TIMEOUT_S", DEFAULT_DRAIN_TIMEOUT_S,
             type=_non_negative_seconds, aliases=("--shutdown-grace-s",),
             help="on SIGTERM/SIGINT: NOT_SERVING at once, no new requests, and this long for those in "
                  "flight to finish before they are cancelled and the process exits (--shutdown-grace-s: "
                  "its former name)")
    from tessera.common.tls import add_server_tls_flags  # (tls imports this module)
    add_server_tls_flags(parser)
    from tessera.common.tracing import add_tracing_flags  # --otlp-traces-endpoint (tracing imports this module)
    add_tracing_flags(parser)

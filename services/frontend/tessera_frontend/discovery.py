"""Where the engine replicas are: `--engine-addrs` entries, resolved to one address per replica.

An entry is `host:port` (`[v6addr]:port` for an IPv6 literal; a missing port
means the engine's default 50053; a gRPC-style `dns:///` prefix is accepted and
ignored). Each entry is resolved with the system resolver (getaddrinfo), and
every address it yields is one replica: a Kubernetes headless service name
resolves to one address per ready engine pod, an IP literal or a plain host
name to one. When a name yields both IPv4 and IPv6 addresses only the IPv4 ones
are used (`localhost` and dual-stack names would otherwise count one engine
twice). The engine client re-resolves periodically; an entry that fails to
resolve keeps its previous addresses (a DNS hiccup does not drop replicas).
"""
from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import logging
import socket
from typing import Awaitable, Callable, Iterable

log = logging.getLogger(__name__)

DEFAULT_ENGINE_PORT = 50053

# (host, port) -> addresses "ip:port" / "[ip6]:port"
Resolver = Callable[[str, int], Awaitable[list[str]]]


@dataclasses.dataclass(frozen=True)
class EngineEntry:
    """One configured engine location, as written."""
    host: str
    port: int

    def __str__(self) -> str:
        return format_addr(self.host, self.port)


def format_addr(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_engine_addr(text: str, default_port: int = DEFAULT_ENGINE_PORT, what: str = "engine") -> EngineEntry:
    """`host:port`, `[v6]:port`, `host` or `dns:///host:port` -> EngineEntry (ValueError if malformed).
    (The tokenizer's addresses are written the same way, with its own default port.)"""
    raw = text.strip()
    spec = raw.removeprefix("dns:///")
    if not spec:
        raise ValueError(f"{what} address {text!r} is empty")
    if spec.startswith("["):
        host, sep, rest = spec[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"{what} address {text!r}: expected [ipv6]:port")
        port_text = rest[1:]
    elif spec.count(":") > 1:  # a bare IPv6 literal without a port
        host, port_text = spec, ""
    else:
        host, _, port_text = spec.partition(":")
    if not host:
        raise ValueError(f"{what} address {text!r} has no host")
    try:
        port = int(port_text) if port_text else default_port
    except ValueError:
        raise ValueError(f"{what} address {text!r}: port {port_text!r} is not a number") from None
    if not 0 < port < 65536:
        raise ValueError(f"{what} address {text!r}: port {port} is out of range")
    return EngineEntry(host, port)


def parse_engine_addrs(value: str | Iterable[str], default_port: int = DEFAULT_ENGINE_PORT,
                       what: str = "engine") -> list[EngineEntry]:
    """A comma-separated list (or a list of strings) of entries; at least one."""
    parts = value.split(",") if isinstance(value, str) else list(value)
    entries = [parse_engine_addr(p, default_port, what) for p in parts if p.strip()]
    if not entries:
        raise ValueError(f"no {what} address given")
    return list(dict.fromkeys(entries))


async def system_resolve(host: str, port: int) -> list[str]:
    """The addresses `host` resolves to (IPv4 ones when there are any), in resolver order."""
    try:
        ipaddress.ip_address(host)
        return [format_addr(host, port)]  # a literal needs no lookup
    except ValueError:
        pass
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    # getaddrinfo's entries: (family, type, proto, canonname, sockaddr); sockaddr starts with the IP.
    v4 = [sockaddr[0] for family, _, _, _, sockaddr in infos if family == socket.AF_INET]
    v6 = [sockaddr[0] for family, _, _, _, sockaddr in infos if family == socket.AF_INET6]
    return [format_addr(ip, port) for ip in dict.fromkeys(v4 or v6)]


async def resolve_entries(entries: Iterable[EngineEntry], resolver: Resolver,
                          previous: dict[EngineEntry, list[str]]) -> dict[EngineEntry, list[str]]:
    """Resolve every entry; one that fails keeps its `previous` addresses."""
    entries = list(entries)
    answers = await asyncio.gather(*(resolver(e.host, e.port) for e in entries), return_exceptions=True)
    resolved: dict[EngineEntry, list[str]] = {}
    for entry, answer in zip(entries, answers):
        if isinstance(answer, BaseException):
            if not isinstance(answer, (OSError, asyncio.TimeoutError)):
                raise answer
            kept = previous.get(entry, [])
            log.warning("engine address did not resolve; keeping the last answer",
                        extra={"engine_entry": str(entry), "error": str(answer), "kept": kept})
            resolved[entry] = kept
        else:
            resolved[entry] = list(answer)
    return resolved

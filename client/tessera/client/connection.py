"""How a client reaches the frontend: address, API key, TLS / mutual TLS, channel options and
the call deadline (pure: builds credentials and metadata; the clients open the channel).

TLS: `tls=True` verifies the server against the system's roots; `ca_file` (a path, or the PEM
bytes) against that CA (and implies TLS); `cert_file` + `key_file` present a client certificate
(mutual TLS); `server_name` checks the certificate against that name instead of the address's
host. The API key goes as `authorization: Bearer <key>` metadata on every call, as the frontend's
--api-key wants. Defaults from the environment: TESSERA_FRONTEND_ADDR (else localhost:50051)
and TESSERA_API_KEY (its first key when comma-separated, as the server's flag takes several).
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
import time
from typing import Sequence, Union

import grpc

DEFAULT_ADDRESS = "localhost:50051"
DEFAULT_TIMEOUT_S = 600.0   # a call's deadline, retries included (as openai's client)
MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # as the services' channels (long prompts, many logprobs)
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # gRPC's own transparent retries stay on; its configurable retries are ours (retries.py)
    ("grpc.enable_retries", 1),
    # a frontend that was down is tried again within seconds (gRPC's default waits up to 120 s,
    # failing every call at once meanwhile, which no retry of ours could outlast)
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 5000),
]

Pem = Union[str, os.PathLike, bytes]


def _pem(name: str, value: Pem | None) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    try:
        return pathlib.Path(value).read_bytes()
    except OSError as exc:
        raise ValueError(f"{name}: cannot read {value}: {exc.strerror or exc}") from None


@dataclasses.dataclass(frozen=True)
class Connection:
    address: str
    credentials: grpc.ChannelCredentials | None   # None: plaintext
    metadata: tuple[tuple[str, str], ...]          # sent on every call (the API key, the caller's)
    options: tuple[tuple[str, object], ...]


def connection(address: str | None = None, *, api_key: str | None = None, tls: bool = False,
               ca_file: Pem | None = None, cert_file: Pem | None = None, key_file: Pem | None = None,
               server_name: str | None = None, metadata: Sequence[tuple[str, str]] = (),
               channel_options: Sequence[tuple[str, object]] = ()) -> Connection:
    address = address or os.environ.get("TESSERA_FRONTEND_ADDR") or DEFAULT_ADDRESS
    if api_key is None:
        api_key = os.environ.get("TESSERA_API_KEY", "").split(",")[0].strip() or None
    ca, cert, key = _pem("ca_file", ca_file), _pem("cert_file", cert_file), _pem("key_file", key_file)
    if (cert is None) != (key is None):
        raise ValueError("cert_file and key_file: give both (mutual TLS) or neither")
    credentials = None
    if tls or ca is not None or cert is not None:
        credentials = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
    elif server_name:
        raise ValueError("server_name: only with TLS (tls=True or ca_file)")
    options = [*CHANNEL_OPTIONS, *channel_options]
    if server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    md = tuple(metadata) + ((("authorization", f"Bearer {api_key}"),) if api_key else ())
    return Connection(address, credentials, md, tuple(options))


def sync_channel(c: Connection) -> grpc.Channel:
    if c.credentials is None:
        return grpc.insecure_channel(c.address, options=list(c.options))
    return grpc.secure_channel(c.address, c.credentials, options=list(c.options))


def aio_channel(c: Connection) -> grpc.aio.Channel:
    if c.credentials is None:
        return grpc.aio.insecure_channel(c.address, options=list(c.options))
    return grpc.aio.secure_channel(c.address, c.credentials, options=list(c.options))


class Deadline:
    """A call's deadline over all its attempts; `remaining()` is None when there is none."""

    def __init__(self, timeout: float | None) -> None:
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout: must be > 0 seconds (or None), got {timeout}")
        self.timeout = timeout
        self.at = None if timeout is None else time.monotonic() + timeout

    def remaining(self) -> float | None:
        return None if self.at is None else self.at - time.monotonic()

    def expired(self) -> bool:
        left = self.remaining()
        return left is not None and left <= 0

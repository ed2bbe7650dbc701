"""TLS from PEM files, by flag: a service's gRPC port (and the frontend's HTTP API) as a
server, and the frontend's channels to the tokenizer and the engines as a client.

Server side (every service): `--tls-cert-file` and `--tls-key-file` serve the gRPC port
over TLS; `--tls-client-ca-file` also requires each client to present a certificate that
this CA signed (mutual TLS: the internal services accept only the frontend). The metrics
port (Prometheus, HTTP /health for probes) stays plain HTTP.

Client side (the frontend): `--backend-tls-ca-file` verifies the tokenizer's and the
engines' certificates against this CA; `--backend-tls-cert-file` / `--backend-tls-key-file`
present the frontend's own certificate (for their --tls-client-ca-file). A certificate
is checked against the host name the address was configured with (`tessera-engine` for
a headless service name, even when its replicas are reached by IP), so certificates
name the services, not the pods.
"""
from __future__ import annotations

import argparse
import dataclasses
import pathlib

import grpc

from tessera.common.flags import add_flag


@dataclasses.dataclass(frozen=True)
class ServerTls:
    cert: bytes
    key: bytes
    client_ca: bytes | None = None  # mutual TLS: clients need a certificate this CA signed

    def grpc_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.client_ca,
                                           require_client_auth=self.client_ca is not None)


@dataclasses.dataclass(frozen=True)
class ClientTls:
    ca: bytes
    cert: bytes | None = None
    key: bytes | None = None

    def grpc_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)


def _read(flag: str, path: str | None) -> bytes | None:
    if not path:
        return None
    try:
        return pathlib.Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{flag}: cannot read {path}: {exc.strerror or exc}") from None


def add_server_tls_flags(parser: argparse.ArgumentParser) -> None:
    add_flag(parser, "--tls-cert-file", "TESSERA_TLS_CERT_FILE", None,
             help="PEM certificate (chain): serve the gRPC port (and the frontend's HTTP API) over TLS")
    add_flag(parser, "--tls-key-file", "TESSERA_TLS_KEY_FILE", None, help="PEM private key of --tls-cert-file")
    add_flag(parser, "--tls-client-ca-file", "TESSERA_TLS_CLIENT_CA_FILE", None,
             help="PEM CA: gRPC clients must present a certificate it signed (mutual TLS)")


def server_tls(args: argparse.Namespace) -> ServerTls | None:
    """The server TLS the flags ask for (None: plaintext); ValueError naming the flag when wrong."""
    cert = _read("--tls-cert-file", args.tls_cert_file)
    key = _read("--tls-key-file", args.tls_key_file)
    client_ca = _read("--tls-client-ca-file", args.tls_client_ca_file)
    if (cert is None) != (key is None):
        raise ValueError("--tls-cert-file and --tls-key-file go together")
    if cert is None:
        if client_ca is not None:
            raise ValueError("--tls-client-ca-file needs --tls-cert-file and --tls-key-file")
        return None
    return ServerTls(cert, key, client_ca)


def add_client_tls_flags(parser: argparse.ArgumentParser) -> None:
    add_flag(parser, "--backend-tls-ca-file", "TESSERA_BACKEND_TLS_CA_FILE", None,
             help="PEM CA: reach the tokenizer and the engines over TLS, verifying their certificates")
    add_flag(parser, "--backend-tls-cert-file", "TESSERA_BACKEND_TLS_CERT_FILE", None,
             help="PEM certificate this frontend presents to them (their --tls-client-ca-file)")
    add_flag(parser, "--backend-tls-key-file", "TESSERA_BACKEND_TLS_KEY_FILE", None,
             help="PEM private key of --backend-tls-cert-file")


def client_tls(args: argparse.Namespace) -> ClientTls | None:
    """The client TLS the flags ask for (None: plaintext); ValueError naming the flag when wrong."""
    ca = _read("--backend-tls-ca-file", args.backend_tls_ca_file)
    cert = _read("--backend-tls-cert-file", args.backend_tls_cert_file)
    key = _read("--backend-tls-key-file", args.backend_tls_key_file)
    if (cert is None) != (key is None):
        raise ValueError("--backend-tls-cert-file and --backend-tls-key-file go together")
    if ca is None:
        if cert is not None:
            raise ValueError("--backend-tls-cert-file needs --backend-tls-ca-file")
        return None
    return ClientTls(ca, cert, key)


def check_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A TLS flag that is wrong (a missing partner, an unreadable file) is a usage error."""
    try:
        server_tls(args)
        if hasattr(args, "backend_tls_ca_file"):
            client_tls(args)
    except ValueError as exc:
        parser.error(str(exc))


def channel(target: str, tls: ClientTls | None, options: list, server_name: str | None = None) -> grpc.aio.Channel:
    """A grpc.aio channel to `target`, over TLS when `tls` is given (the certificate checked
    against `server_name`, default the target's host)."""
    if tls is None:
        return grpc.aio.insecure_channel(target, options=options)
    if server_name:
        options = [*options, ("grpc.ssl_target_name_override", server_name)]
    return grpc.aio.secure_channel(target, tls.grpc_credentials(), options=options)

"""TLS on every hop: a stack of three processes (tokenizer, engine, frontend) with
certificates from a test CA (trustme). The frontend serves gRPC and HTTPS to clients; the
tokenizer and the engine accept only clients with a certificate from the CA (mutual TLS),
which the frontend presents. Checked: TLS clients of both public APIs get answers; a
plaintext client does not; the mTLS hops work (the stack serves through them); a client
without the client certificate, or one not signed by the CA, is refused by the engine."""
from __future__ import annotations

import pathlib
import ssl
import tempfile
import time

import http.client

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from helpers.stack import Service, all_serving, free_port, frontend_service
from tessera.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc, tokenizer_pb2

pytestmark = pytest.mark.integration

trustme = pytest.importorskip("trustme")

SERVING = health_pb2.HealthCheckResponse.SERVING


class _Secure(Service):
    """A Service whose readiness is asked over TLS (with the client certificate)."""
    credentials: grpc.ChannelCredentials | None = None

    def wait_serving(self, deadline: float, timeout_s: float | None = None) -> None:
        with grpc.secure_channel(self.addr, self.credentials) as channel:
            while True:
                code = self.process.poll()
                assert code is None, f"{self.name} exited with {code}:\n{self.log_tail()}"
                try:
                    if _health(channel) == SERVING:
                        return
                except grpc.RpcError:
                    pass
                assert time.monotonic() < deadline, f"{self.name} not SERVING:\n{self.log_tail()}"
                time.sleep(0.25)


def _health(channel) -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


@pytest.fixture(scope="module")
def tls_stack():
    ca = trustme.CA()
    other_ca = trustme.CA()
    d = pathlib.Path(tempfile.mkdtemp(prefix="tessera-tls-"))
    ca_file = d / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    server = ca.issue_cert("127.0.0.1", "localhost")
    server.cert_chain_pems[0].write_to_path(str(d / "server.pem"))
    server.private_key_pem.write_to_path(str(d / "server.key"))
    client = ca.issue_cert("tessera-frontend")
    client.cert_chain_pems[0].write_to_path(str(d / "client.pem"))
    client.private_key_pem.write_to_path(str(d / "client.key"))
    stranger = other_ca.issue_cert("stranger")
    serve_mtls = ["--tls-cert-file", str(d / "server.pem"), "--tls-key-file", str(d / "server.key"),
                  "--tls-client-ca-file", str(ca_file)]
    client_creds = grpc.ssl_channel_credentials(ca.cert_pem.bytes(), client.private_key_pem.bytes(),
                                                client.cert_chain_pems[0].bytes())
    tokenizer = _Secure("tokenizer-tls", "tessera_tokenizer", free_port(), serve_mtls, d / "tokenizer.log")
    engine = _Secure("engine-tls", "tessera_engine", free_port(), serve_mtls, d / "engine.log")
    tokenizer.credentials = engine.credentials = client_creds
    base = frontend_service("frontend-tls", tokenizer.addr, engine.addr, d,
                            "--tls-cert-file", str(d / "server.pem"), "--tls-key-file", str(d / "server.key"),
                            "--backend-tls-ca-file", str(ca_file), "--backend-tls-cert-file", str(d / "client.pem"),
                            "--backend-tls-key-file", str(d / "client.key"))
    frontend = _Secure(base.name, base.module, base.port, base.args, base.log_path, http_port=base.http_port)
    frontend.credentials = grpc.ssl_channel_credentials(ca.cert_pem.bytes())
    with all_serving(tokenizer, engine, frontend):
        yield {"ca": ca, "ca_file": ca_file, "client": client, "stranger": stranger, "tokenizer": tokenizer,
               "engine": engine, "frontend": frontend}


def _request() -> frontend_pb2.GenerateRequest:
    chat = tokenizer_pb2.ChatMessages(messages=[tokenizer_pb2.ChatMessage(role="user", content="Say hi.")])
    return frontend_pb2.GenerateRequest(chat=chat, sampling_params=common_pb2.SamplingParams(
        temperature=0.0, max_tokens=3, ignore_eos=True))


def test_public_apis_over_tls(tls_stack):
    frontend = tls_stack["frontend"]
    with grpc.secure_channel(frontend.addr, frontend.credentials) as channel:
        result = frontend_pb2_grpc.FrontendServiceStub(channel).Complete(_request(), timeout=120)
    assert result.usage.completion_tokens == 3  # through the mTLS hops to the tokenizer and the engine
    with grpc.insecure_channel(frontend.addr) as plain:
        with pytest.raises(grpc.RpcError) as refused:
            frontend_pb2_grpc.FrontendServiceStub(plain).Complete(_request(), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

    https = f"https://127.0.0.1:{frontend.http_port}"
    trusting = ssl.create_default_context(cafile=str(tls_stack["ca_file"]))
    client = openai.OpenAI(base_url=https + "/v1", api_key="unused", max_retries=0, timeout=120,
                           http_client=openai.DefaultHttpxClient(verify=trusting))
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hi."}],
                                           max_tokens=3, temperature=0.0)
    assert reply.usage.completion_tokens >= 1
    conn = http.client.HTTPSConnection("127.0.0.1", frontend.http_port, timeout=10, context=trusting)
    conn.request("GET", "/health")
    assert conn.getresponse().status == 200
    untrusting = http.client.HTTPSConnection("127.0.0.1", frontend.http_port, timeout=10,
                                             context=ssl.create_default_context())
    with pytest.raises(ssl.SSLCertVerificationError):  # a client that does not trust the CA
        untrusting.request("GET", "/health")


def test_internal_services_refuse_clients_without_the_client_certificate(tls_stack):
    ca, engine, tokenizer = tls_stack["ca"], tls_stack["engine"], tls_stack["tokenizer"]
    stranger = tls_stack["stranger"]
    attempts = {
        "no client certificate": grpc.ssl_channel_credentials(ca.cert_pem.bytes()),
        "a certificate from another CA": grpc.ssl_channel_credentials(
            ca.cert_pem.bytes(), stranger.private_key_pem.bytes(), stranger.cert_chain_pems[0].bytes()),
    }
    for service in (engine, tokenizer):
        for what, creds in attempts.items():
            with grpc.secure_channel(service.addr, creds) as channel:
                with pytest.raises(grpc.RpcError) as refused:
                    _health(channel)
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, (service.name, what)
        with grpc.insecure_channel(service.addr) as plain:
            with pytest.raises(grpc.RpcError):
                _health(plain)
        with grpc.secure_channel(service.addr, service.credentials) as channel:
            assert _health(channel) == SERVING


def test_wrong_tls_flags_are_usage_errors_naming_the_flag(tmp_path):
    import subprocess
    import sys
    pem = tmp_path / "x.pem"
    pem.write_text("not a real certificate")
    cases = [
        ("tessera_engine", ["--tls-cert-file", str(pem)], "--tls-cert-file and --tls-key-file go together"),
        ("tessera_tokenizer", ["--tls-client-ca-file", str(pem)], "--tls-client-ca-file needs --tls-cert-file"),
        ("tessera_frontend", ["--tls-cert-file", str(tmp_path / "missing.pem"), "--tls-key-file", str(pem)],
         "--tls-cert-file: cannot read"),
        ("tessera_frontend", ["--backend-tls-cert-file", str(pem), "--backend-tls-key-file", str(pem)],
         "--backend-tls-cert-file needs --backend-tls-ca-file"),
        ("tessera_frontend", ["--tokenizer-timeout-s", "0"], "--tokenizer-timeout-s: expected seconds > 0"),
        ("tessera_frontend", ["--engine-timeout-s", "-1"], "--engine-timeout-s: expected seconds > 0"),
    ]
    for module, flags, message in cases:
        done = subprocess.run([sys.executable, "-m", module, *flags], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and message in done.stderr, (module, flags, done.stderr[-500:])

"""The client's API key and TLS / mutual TLS options against a real frontend that asks for
all three (--api-key, --tls-cert-file / --tls-key-file, --tls-client-ca-file), in front of
the shared stack's backends; and the CLI's same options (integration)."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest

from helpers.stack import Service, all_serving, frontend_service, stack  # noqa: F401  (the session fixture)
from tessera.client import Client, UnauthenticatedError, UnavailableError

pytestmark = pytest.mark.integration

trustme = pytest.importorskip("trustme")

KEY = "sk-client-test"


class _HttpReady(Service):
    """Ready when its metrics port's HTTP /health says SERVING (its gRPC port wants TLS and a client
    certificate, which launch's plaintext readiness probe does not have)."""

    def wait_serving(self, deadline: float, timeout_s: float | None = None) -> None:
        while True:
            assert self.process.poll() is None, f"{self.name} exited:\n{self.log_tail()}"
            try:
                with urllib.request.urlopen(f"{self.metrics_url}/health", timeout=2) as reply:
                    if json.loads(reply.read()).get("status") == "SERVING":
                        return
            except OSError:
                pass
            assert time.monotonic() < deadline, f"{self.name} not SERVING:\n{self.log_tail()}"
            time.sleep(0.25)


@pytest.fixture(scope="module")
def secure(stack):  # noqa: F811
    ca = trustme.CA()
    d = pathlib.Path(tempfile.mkdtemp(prefix="tessera-client-tls-"))
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    server = ca.issue_cert("127.0.0.1", "localhost")
    server.cert_chain_pems[0].write_to_path(str(d / "server.pem"))
    server.private_key_pem.write_to_path(str(d / "server.key"))
    user = ca.issue_cert("a-client")
    user.cert_chain_pems[0].write_to_path(str(d / "client.pem"))
    user.private_key_pem.write_to_path(str(d / "client.key"))
    base = frontend_service("frontend-client-secure", stack.tokenizer.addr, stack.engine.addr, d,
                            "--tls-cert-file", str(d / "server.pem"), "--tls-key-file", str(d / "server.key"),
                            "--tls-client-ca-file", str(d / "ca.pem"), "--api-key", f"other,{KEY}")
    frontend = _HttpReady(base.name, base.module, base.port, base.args, base.log_path, http_port=base.http_port)
    with all_serving(frontend):
        yield frontend, d


def test_tls_mtls_and_api_key(secure):
    frontend, d = secure
    files = dict(ca_file=d / "ca.pem", cert_file=d / "client.pem", key_file=d / "client.key")
    with Client(frontend.addr, api_key=KEY, timeout=60, **files) as client:
        answer = client.complete(prompt="The capital of France is", max_tokens=4, temperature=0)
        assert answer.choices[0].token_ids
        assert "".join(d.text for d in client.generate(prompt="The capital of France is", max_tokens=4,
                                                         temperature=0)) == answer.text
    # the same from PEM bytes
    pems = {k: v.read_bytes() for k, v in files.items()}
    with Client(frontend.addr, api_key=KEY, timeout=60, **pems) as client:
        assert client.complete(prompt="Hi", max_tokens=2).choices[0].token_ids
    # no key, a wrong key: UNAUTHENTICATED with the server's message
    for key in (None, "sk-wrong"):
        with Client(frontend.addr, api_key=key, timeout=60, **files) as client, \
                pytest.raises(UnauthenticatedError) as caught:
            client.complete(prompt="Hi", max_tokens=2)
        assert "API key" in caught.value.message
    # no client certificate, or plaintext: the handshake fails (not retried for ever: max_retries=0)
    for kwargs in ({"ca_file": d / "ca.pem"}, {}):
        with Client(frontend.addr, api_key=KEY, timeout=20, max_retries=0, **kwargs) as client, \
                pytest.raises(UnavailableError):
            client.complete(prompt="Hi", max_tokens=2)
    with pytest.raises(ValueError, match="cert_file and key_file"):
        Client(frontend.addr, cert_file=d / "client.pem")
    with pytest.raises(ValueError, match="ca_file: cannot read"):
        Client(frontend.addr, ca_file=d / "missing.pem")


def test_cli_generate_with_key_and_tls(secure):
    frontend, d = secure
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    env.update(TESSERA_API_KEY=KEY, TESSERA_CLIENT_CA_FILE=str(d / "ca.pem"))
    done = subprocess.run([sys.executable, "-m", "tessera.cli", "generate", "The capital of France is", "--raw",
                           "--addr", frontend.addr, "--max-tokens", "4", "--temperature", "0",
                           "--cert-file", str(d / "client.pem"), "--key-file", str(d / "client.key")],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() and "completion_tokens=4" in done.stderr
    env.pop("TESSERA_API_KEY")
    done = subprocess.run([sys.executable, "-m", "tessera.cli", "generate", "Hi", "--addr", frontend.addr,
                           "--cert-file", str(d / "client.pem"), "--key-file", str(d / "client.key")],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 1 and "UNAUTHENTICATED" in done.stderr

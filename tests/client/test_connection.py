"""tessera.client.connection: address, API key, TLS options, deadlines (unit)."""
from __future__ import annotations

import time

import pytest

from tessera.client.connection import DEFAULT_ADDRESS, Deadline, connection

pytestmark = pytest.mark.unit


def test_defaults_come_from_the_environment(monkeypatch):
    monkeypatch.delenv("TESSERA_FRONTEND_ADDR", raising=False)
    monkeypatch.delenv("TESSERA_API_KEY", raising=False)
    c = connection()
    assert c.address == DEFAULT_ADDRESS == "localhost:50051" and c.metadata == () and c.credentials is None
    monkeypatch.setenv("TESSERA_FRONTEND_ADDR", "frontend:1234")
    monkeypatch.setenv("TESSERA_API_KEY", "k1, k2")
    c = connection()
    assert c.address == "frontend:1234" and c.metadata == (("authorization", "Bearer k1"),)
    assert connection("h:1", api_key="mine", metadata=[("x-request-id", "r")]).metadata == \
        (("x-request-id", "r"), ("authorization", "Bearer mine"))


def test_tls_options(tmp_path):
    assert connection("h:1", tls=True).credentials is not None
    c = connection("h:1", ca_file=b"-----BEGIN CERTIFICATE-----\n", server_name="tessera-frontend")
    assert c.credentials is not None and ("grpc.ssl_target_name_override", "tessera-frontend") in c.options
    with pytest.raises(ValueError, match="cert_file and key_file"):
        connection("h:1", ca_file=b"x", cert_file=b"y")
    with pytest.raises(ValueError, match="ca_file: cannot read"):
        connection("h:1", ca_file=tmp_path / "missing.pem")
    with pytest.raises(ValueError, match="server_name: only with TLS"):
        connection("h:1", server_name="x")


def test_deadline():
    assert Deadline(None).remaining() is None and not Deadline(None).expired()
    d = Deadline(0.05)
    assert 0 < d.remaining() <= 0.05
    time.sleep(0.06)
    assert d.expired()
    with pytest.raises(ValueError, match="timeout"):
        Deadline(0)

"""tessera.client.errors: one exception class per gRPC status, with the server's message (unit)."""
from __future__ import annotations

import grpc
import pytest

from tessera import client
from tessera.client.errors import ERROR_CLASSES, error_for

pytestmark = pytest.mark.unit


def test_every_status_but_ok_has_its_class():
    assert set(ERROR_CLASSES) == set(grpc.StatusCode) - {grpc.StatusCode.OK}
    for code, cls in ERROR_CLASSES.items():
        assert cls.code is code and issubclass(cls, client.APIStatusError)
        assert getattr(client, cls.__name__) is cls  # exported


def test_the_error_carries_the_servers_message():
    error = error_for(grpc.StatusCode.INVALID_ARGUMENT, "sampling_params.temperature: must be >= 0",
                      request_id="r1")
    assert isinstance(error, client.InvalidArgumentError) and isinstance(error, client.TesseraError)
    assert error.message == "sampling_params.temperature: must be >= 0"
    assert str(error) == "INVALID_ARGUMENT: sampling_params.temperature: must be >= 0"
    assert error.code is grpc.StatusCode.INVALID_ARGUMENT and error.request_id == "r1"
    assert isinstance(error_for(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"), client.DeadlineExceededError)

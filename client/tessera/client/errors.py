"""The exceptions: one class per gRPC status code, each carrying the server's message.

`TesseraError` is the base of everything the client raises for a failed call; `APIStatusError`
(its subclass) is a call that ended with a status: `.code` (grpc.StatusCode), `.message` (the
server's own text, e.g. "sampling_params.temperature: must be ..."), `.request_id` when known.
`ResourceExhaustedError.retry_after` is the server's retry hint in seconds, if it sent one.
"""
from __future__ import annotations

import grpc


class TesseraError(Exception):
    """Base class of the client's errors."""


class APIStatusError(TesseraError):
    """A call ended with a non-OK gRPC status."""
    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, *, code: grpc.StatusCode | None = None, request_id: str | None = None,
                 retry_after: float | None = None) -> None:
        if code is not None:
            self.code = code
        self.message = message
        self.request_id = request_id
        self.retry_after = retry_after
        super().__init__(f"{self.code.name}: {message}")


class CancelledError(APIStatusError):
    code = grpc.StatusCode.CANCELLED


class UnknownError(APIStatusError):
    code = grpc.StatusCode.UNKNOWN


class InvalidArgumentError(APIStatusError):
    """A request field is out of range or malformed; the message starts with the field's name."""
    code = grpc.StatusCode.INVALID_ARGUMENT


class DeadlineExceededError(APIStatusError):
    """The call's deadline (`timeout`) passed before it finished."""
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class NotFoundError(APIStatusError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExistsError(APIStatusError):
    code = grpc.StatusCode.ALREADY_EXISTS


class PermissionDeniedError(APIStatusError):
    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhaustedError(APIStatusError):
    """The frontend is at its limit of requests in flight (--max-inflight-requests)."""
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPreconditionError(APIStatusError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class AbortedError(APIStatusError):
    code = grpc.StatusCode.ABORTED


class OutOfRangeError(APIStatusError):
    code = grpc.StatusCode.OUT_OF_RANGE


class UnimplementedError(APIStatusError):
    code = grpc.StatusCode.UNIMPLEMENTED


class InternalError(APIStatusError):
    code = grpc.StatusCode.INTERNAL


class UnavailableError(APIStatusError):
    """No frontend answers, or the frontend has no engine or tokenizer (NOT_SERVING)."""
    code = grpc.StatusCode.UNAVAILABLE


class DataLossError(APIStatusError):
    code = grpc.StatusCode.DATA_LOSS


class UnauthenticatedError(APIStatusError):
    """No API key, or not one the frontend accepts (`api_key=`)."""
    code = grpc.StatusCode.UNAUTHENTICATED


ERROR_CLASSES: dict[grpc.StatusCode, type[APIStatusError]] = {
    cls.code: cls for cls in (
        CancelledError, UnknownError, InvalidArgumentError, DeadlineExceededError, NotFoundError,
        AlreadyExistsError, PermissionDeniedError, ResourceExhaustedError, FailedPreconditionError,
        AbortedError, OutOfRangeError, UnimplementedError, InternalError, UnavailableError,
        DataLossError, UnauthenticatedError)
}


def error_for(code: grpc.StatusCode, message: str, *, request_id: str | None = None,
              retry_after: float | None = None) -> APIStatusError:
    """The exception for a call that ended with `code` and the server's `message`."""
    cls = ERROR_CLASSES.get(code, UnknownError)
    return cls(message, code=code, request_id=request_id, retry_after=retry_after)

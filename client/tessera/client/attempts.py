"""What a failed attempt of a call leads to, for both clients: a wait before the next attempt
(retries.RetryPolicy decides, with the server's hint and the call's deadline), or the typed
error to raise (errors.error_for, with the server's message)."""
from __future__ import annotations

import grpc

from tessera.client.connection import Deadline
from tessera.client.errors import APIStatusError, DeadlineExceededError, error_for
from tessera.client.retries import RetryPolicy, retry_hint


def _trailers(exc: grpc.RpcError):
    try:
        return exc.trailing_metadata()
    except Exception:  # noqa: BLE001 (a call that never started may have none to give)
        return None


def to_error(exc: grpc.RpcError, request_id: str | None = None, trailers=None) -> APIStatusError:
    hint = retry_hint(trailers if trailers is not None else _trailers(exc))
    return error_for(exc.code(), exc.details() or "", request_id=request_id or None,
                     retry_after=hint if hint is not None and hint != float("inf") else None)


def retry_wait(policy: RetryPolicy, exc: grpc.RpcError, retries_done: int, received_output: bool,
               deadline: Deadline) -> float | None:
    """Seconds to wait before trying again; None: raise (not retryable, out of retries, or the
    wait would pass the deadline)."""
    if not policy.should_retry(exc.code(), retries_done, received_output):
        return None
    wait = policy.backoff(retries_done, retry_hint(_trailers(exc)))
    return wait if policy.fits(wait, deadline.remaining()) else None


def deadline_error(deadline: Deadline, request_id: str | None = None) -> DeadlineExceededError:
    return DeadlineExceededError(f"the call's deadline ({deadline.timeout:g}s) passed", request_id=request_id or None)

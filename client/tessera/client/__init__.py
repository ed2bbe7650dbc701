"""tessera.client: a typed Python client of tessera's public gRPC API (FrontendService), sync
(`Client`) and asyncio (`AsyncClient`), modelled on the `openai` package: typed results, one
reused channel, deadlines, retries before the first token, an exception per gRPC status.

    from tessera.client import AsyncClient

    async with AsyncClient("localhost:50051") as client:
        async for delta in client.generate(messages=[{"role": "user", "content": "Hi"}], max_tokens=32):
            print(delta.text, end="")

Modules: sync_client / async_client (the clients and their streams), requests (arguments to a
GenerateRequest), types (the results), results (with tool calls), tool_calls (parsing the
model's calls), errors, retries (the policy), attempts (a failed attempt: retry or raise),
connection (address, API key, TLS, deadlines).
"""
from tessera.client.async_client import AsyncClient, AsyncStream
from tessera.client.connection import DEFAULT_ADDRESS
from tessera.client.errors import (
    AbortedError, AlreadyExistsError, APIStatusError, CancelledError, DataLossError, DeadlineExceededError,
    FailedPreconditionError, InternalError, InvalidArgumentError, NotFoundError, OutOfRangeError,
    PermissionDeniedError, ResourceExhaustedError, TesseraError, UnauthenticatedError, UnavailableError,
    UnimplementedError, UnknownError)
from tessera.client.requests import GenerateArgs, Message
from tessera.client.retries import RetryPolicy
from tessera.client.sync_client import Client, Stream
from tessera.client.tool_calls import ToolCall
from tessera.client.types import Choice, Completion, Delta, PositionLogprobs, TokenLogprob, Usage

__all__ = [
    "AsyncClient", "AsyncStream", "Client", "Stream", "DEFAULT_ADDRESS", "GenerateArgs", "Message", "RetryPolicy",
    "ToolCall", "Choice", "Completion", "Delta", "PositionLogprobs", "TokenLogprob", "Usage",
    "TesseraError", "APIStatusError", "AbortedError", "AlreadyExistsError", "CancelledError", "DataLossError",
    "DeadlineExceededError", "FailedPreconditionError", "InternalError", "InvalidArgumentError", "NotFoundError",
    "OutOfRangeError", "PermissionDeniedError", "ResourceExhaustedError", "UnauthenticatedError",
    "UnavailableError", "UnimplementedError", "UnknownError",
]

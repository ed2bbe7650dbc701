"""`Client`: the blocking client (grpc's sync channel), one channel reused by every call.

    with Client("localhost:50051") as client:
        for delta in client.generate(prompt="Once upon a time", max_tokens=32):
            print(delta.text, end="")
        answer = client.complete(messages=[{"role": "user", "content": "Hi"}], max_tokens=32)

`generate()` returns a `Stream` of `Delta`s; leaving the loop cancels the call (dropped at
once, or closed by `with stream` / `stream.close()` when a name holds it).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

import grpc

from tessera.client import attempts, types
from tessera.client.connection import DEFAULT_TIMEOUT_S, Deadline, Pem, connection, sync_channel
from tessera.client.requests import build_request, tokenize_request
from tessera.client.results import DeltaAssembler, completion_with_tools
from tessera.client.retries import RetryPolicy
from tessera.client.types import Completion, Delta
from tessera.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from tessera.client.requests import GenerateArgs

_DEFAULT: Any = object()  # "the client's default" for a call's timeout


class Stream:
    """The deltas of one Generate call (iterator). Retries happen inside, before the first delta only."""

    def __init__(self, start: Callable[[float | None], Any], assembler: DeltaAssembler, policy: RetryPolicy,
                 deadline: Deadline, request_id: str) -> None:
        self._start = start
        self._assembler = assembler
        self._policy = policy
        self._deadline = deadline
        self._request_id = request_id
        self._call = None
        self._received = False
        self._retries = 0
        self._closed = False

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> Delta:
        while True:
            if self._closed:
                raise StopIteration
            if self._call is None:
                if self._deadline.expired():
                    self._closed = True
                    raise attempts.deadline_error(self._deadline, self._request_id)
                self._call = self._start(self._deadline.remaining())
            try:
                message = next(self._call)
            except StopIteration:
                self._closed = True
                self._call = None
                raise
            except grpc.RpcError as exc:
                self._call = None
                if self._closed:  # cancelled by close(): the stream just ends
                    raise StopIteration from None
                wait = attempts.retry_wait(self._policy, exc, self._retries, self._received, self._deadline)
                if wait is None:
                    self._closed = True
                    raise attempts.to_error(exc, self._request_id) from None
                self._retries += 1
                time.sleep(wait)
                continue
            self._received = True
            return self._assembler.delta(message)

    def cancel(self) -> None:
        """Cancel the call (the engine aborts the request); the stream ends."""
        self._closed = True
        call, self._call = self._call, None
        if call is not None:
            call.cancel()

    close = cancel

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc_info) -> None:
        self.cancel()

    def __del__(self) -> None:
        if self._call is not None:
            self._call.cancel()


class Client:
    """The frontend's public gRPC API (FrontendService), blocking.

    address      host:port (default TESSERA_FRONTEND_ADDR, else localhost:50051)
    api_key      sent as `authorization: Bearer <key>` (default TESSERA_API_KEY)
    tls, ca_file, cert_file, key_file, server_name
                 TLS (system roots, or ca_file's CA), mutual TLS (cert_file + key_file);
                 files are paths or PEM bytes
    timeout      each call's deadline in seconds, retries included (None: none); a call's own
                 `timeout=` overrides it; past it: DeadlineExceededError
    max_retries  retries of a call that failed with UNAVAILABLE or RESOURCE_EXHAUSTED before its
                 first token (never after), with backoff or the server's hint (retry_policy: all knobs)
    metadata     extra call metadata on every call; channel_options: extra grpc channel options
    """

    def __init__(self, address: str | None = None, *, api_key: str | None = None, tls: bool = False,
                 ca_file: Pem | None = None, cert_file: Pem | None = None, key_file: Pem | None = None,
                 server_name: str | None = None, timeout: float | None = DEFAULT_TIMEOUT_S,
                 max_retries: int = 2, retry_policy: RetryPolicy | None = None,
                 metadata: Sequence[tuple[str, str]] = (), channel_options: Sequence[tuple[str, object]] = ()) -> None:
        self.connection = connection(address, api_key=api_key, tls=tls, ca_file=ca_file, cert_file=cert_file,
                                     key_file=key_file, server_name=server_name, metadata=metadata,
                                     channel_options=channel_options)
        Deadline(timeout)  # checks it
        self.timeout = timeout
        self.retry_policy = retry_policy or RetryPolicy(max_retries=max_retries)
        self._channel = sync_channel(self.connection)
        self.stub = frontend_pb2_grpc.FrontendServiceStub(self._channel)

    @property
    def address(self) -> str:
        return self.connection.address

    @property
    def channel(self) -> grpc.Channel:
        """The client's channel: for the server's other services (e.g. grpc.health.v1)."""
        return self._channel

    def generate(self, *, timeout: float | None = _DEFAULT, metadata: Sequence[tuple[str, str]] = (),
                 **kwargs: Unpack[GenerateArgs]) -> Stream:
        """Stream the answer: a Delta per engine step per choice that produced tokens."""
        request, tool_choice = build_request(**kwargs)
        deadline = self._deadline(timeout)
        md = self.connection.metadata + tuple(metadata)

        def start(remaining: float | None):
            return self.stub.Generate(request, timeout=remaining, metadata=md)

        return Stream(start, DeltaAssembler(tool_choice), self.retry_policy, deadline, request.request_id)

    def complete(self, *, timeout: float | None = _DEFAULT, metadata: Sequence[tuple[str, str]] = (),
                 **kwargs: Unpack[GenerateArgs]) -> Completion:
        """The whole answer once every choice has finished."""
        request, tool_choice = build_request(**kwargs)
        deadline = self._deadline(timeout)
        return completion_with_tools(self._unary(self.stub.Complete, request, deadline, metadata), tool_choice)

    def _unary(self, method, request, deadline: Deadline, metadata: Sequence[tuple[str, str]] = (),
               retry: bool = True):
        """One unary call with retries (it received nothing before it failed)."""
        md = self.connection.metadata + tuple(metadata)
        request_id = getattr(request, "request_id", "")
        retries = 0
        while True:
            if deadline.expired():
                raise attempts.deadline_error(deadline, request_id)
            try:
                return method(request, timeout=deadline.remaining(), metadata=md)
            except grpc.RpcError as exc:
                wait = attempts.retry_wait(self.retry_policy, exc, retries, False, deadline) if retry else None
                if wait is None:
                    raise attempts.to_error(exc, request_id) from None
                retries += 1
                time.sleep(wait)

    # -- the calls beside Generate / Complete (no engine step; retried as Complete is) -----------
    def list_models(self, *, timeout: float | None = _DEFAULT) -> list[types.Model]:
        """The models requests may name: the base model first, then the LoRA adapters."""
        reply = self._unary(self.stub.ListModels, frontend_pb2.ListModelsRequest(), self._deadline(timeout))
        return [types.same_fields(types.Model, m) for m in reply.models]

    def tokenize(self, *, timeout: float | None = _DEFAULT, **kwargs: Any) -> types.Tokens:
        """Text or chat `messages` (with `tools`) to token ids, as a prompt would be tokenized;
        add_special_tokens, add_generation_prompt, return_token_strs, return_offsets as frontend.proto's."""
        return types.tokens(self._unary(self.stub.Tokenize, tokenize_request(**kwargs), self._deadline(timeout)))

    def detokenize(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False,
                   timeout: float | None = _DEFAULT) -> str:
        request = frontend_pb2.FrontendServiceDetokenizeRequest(token_ids=list(token_ids),
                                                                skip_special_tokens=skip_special_tokens)
        return self._unary(self.stub.Detokenize, request, self._deadline(timeout)).text

    def server_info(self, *, timeout: float | None = _DEFAULT) -> types.ServerInfo:
        """The server's version, model and the limits a request must keep to."""
        reply = self._unary(self.stub.GetServerInfo, frontend_pb2.GetServerInfoRequest(), self._deadline(timeout))
        return types.same_fields(types.ServerInfo, reply)

    def list_lora_adapters(self, *, timeout: float | None = _DEFAULT) -> types.LoRAAdapters:
        reply = self._unary(self.stub.ListLoRAAdapters, common_pb2.ListLoRAAdaptersRequest(), self._deadline(timeout))
        return types.lora_adapters(reply)

    def load_lora_adapter(self, lora_name: str, lora_path: str, *, timeout: float | None = _DEFAULT) -> types.LoRAAdapter:
        """Load an adapter on every engine replica (the frontend's --allow-runtime-lora-updating); not retried."""
        request = common_pb2.LoadLoRAAdapterRequest(lora_name=lora_name, lora_path=lora_path)
        reply = self._unary(self.stub.LoadLoRAAdapter, request, self._deadline(timeout), retry=False)
        return types.same_fields(types.LoRAAdapter, reply)

    def unload_lora_adapter(self, lora_name: str, *, timeout: float | None = _DEFAULT) -> types.LoRAAdapter:
        request = common_pb2.UnloadLoRAAdapterRequest(lora_name=lora_name)
        reply = self._unary(self.stub.UnloadLoRAAdapter, request, self._deadline(timeout), retry=False)
        return types.same_fields(types.LoRAAdapter, reply)

    def _deadline(self, timeout: float | None) -> Deadline:
        return Deadline(self.timeout if timeout is _DEFAULT else timeout)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

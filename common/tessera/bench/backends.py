"""One streamed request per API, timed: OpenAI chat completions and completions over HTTP (any
OpenAI-compatible server), and tessera's gRPC Generate."""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import grpc

from tessera.bench.datasets import SampleRequest
from tessera.common.grpc_service import CHANNEL_OPTIONS
from tessera.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc

BACKENDS = ("openai-chat", "openai", "grpc")


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_len: int = 0           # the server's usage.prompt_tokens (the dataset's length without usage)
    output_tokens: int = 0        # the server's usage.completion_tokens (streamed chunks without usage)
    usage_reported: bool = False  # whether output_tokens came from the server's usage
    ttft: float = 0.0             # seconds to the first token
    itl: list[float] = field(default_factory=list)  # seconds between streamed token chunks
    latency: float = 0.0          # end to end, seconds
    start: float = 0.0            # perf_counter at send
    chunks: int = 0               # streamed messages that carried tokens
    last_token: float = 0.0       # perf_counter at the last of them
    text: str = ""

    @property
    def tpot(self) -> float:
        """Time per output token after the first."""
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


Sender = Callable[[SampleRequest], Awaitable[RequestResult]]


class _Timer:
    """Timestamps of a request's token-bearing chunks."""

    def __init__(self, result: RequestResult) -> None:
        self.result = result
        result.start = self.last = time.perf_counter()

    def chunk(self, text: str) -> None:
        now = time.perf_counter()
        r = self.result
        if r.chunks == 0:
            r.ttft = now - r.start
        else:
            r.itl.append(now - self.last)
        self.last = r.last_token = now
        r.chunks += 1
        r.text += text

    def done(self) -> None:
        r = self.result
        r.latency = time.perf_counter() - r.start
        if not r.usage_reported:
            r.output_tokens = r.chunks
        if r.chunks == 0:  # an answer with no text (e.g. EOS at once): its first token is its end
            r.ttft = r.latency
        r.success = True


def http_client(max_connections: int):
    """The HTTP client of the OpenAI backends: up to max_connections requests at once, no read
    timeout a benchmark would hit (httpx2: the client openai itself uses)."""
    import httpx2

    limits = httpx2.Limits(max_connections=max_connections, max_keepalive_connections=min(max_connections, 100))
    return httpx2.AsyncClient(timeout=httpx2.Timeout(6 * 3600.0, connect=30.0), limits=limits)


class OpenAIBackend:
    """POST {base_url}/v1/chat/completions or /v1/completions with stream and include_usage."""

    def __init__(self, client, base_url: str, model: str, chat: bool, ignore_eos: bool) -> None:
        self.client, self.model, self.chat, self.ignore_eos = client, model, chat, ignore_eos
        self.url = base_url.rstrip("/") + ("/v1/chat/completions" if chat else "/v1/completions")
        key = os.environ.get("OPENAI_API_KEY")
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}

    def body(self, sample: SampleRequest) -> dict:
        body: dict = {"model": self.model, "temperature": 0.0, "stream": True,
                      "stream_options": {"include_usage": True}}
        if self.chat:
            messages = [{"role": "system", "content": sample.system}] if sample.system else []
            body["messages"] = messages + [{"role": "user", "content": sample.prompt}]
            body["max_completion_tokens"] = sample.expected_output_len
        else:
            body["prompt"] = sample.text()
            body["max_tokens"] = sample.expected_output_len
        if self.ignore_eos:
            body["ignore_eos"] = True  # a vLLM (and tessera) extension: not sent unless asked
        return body

    async def __call__(self, sample: SampleRequest) -> RequestResult:
        result = RequestResult(prompt_len=sample.prompt_len)
        timer = _Timer(result)
        try:
            async with self.client.stream("POST", self.url, json=self.body(sample), headers=self.headers) as reply:
                if reply.status_code != 200:
                    result.error = f"HTTP {reply.status_code}: {(await reply.aread()).decode(errors='replace')[:500]}"
                    result.latency = time.perf_counter() - result.start
                    return result
                async for line in reply.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    self._chunk(json.loads(data), timer)
        except Exception as exc:  # a failed request is a figure of the run, not its end
            result.error = f"{type(exc).__name__}: {exc}"
            result.latency = time.perf_counter() - result.start
            return result
        timer.done()
        return result

    def _chunk(self, chunk: dict, timer: _Timer) -> None:
        if "error" in chunk:
            raise RuntimeError(str(chunk["error"]))
        for choice in chunk.get("choices") or []:
            text = (choice.get("delta") or {}).get("content") if self.chat else choice.get("text")
            if text:
                timer.chunk(text)
        usage = chunk.get("usage")
        if usage:
            timer.result.prompt_len = usage.get("prompt_tokens", timer.result.prompt_len)
            timer.result.output_tokens = usage.get("completion_tokens", 0)
            timer.result.usage_reported = True


class GrpcBackend:
    """tessera's FrontendService.Generate with the whole prompt as text."""

    def __init__(self, addr: str, ignore_eos: bool) -> None:
        self.channel = grpc.aio.insecure_channel(addr, options=CHANNEL_OPTIONS)
        self.stub = frontend_pb2_grpc.FrontendServiceStub(self.channel)
        self.ignore_eos = ignore_eos
        key = os.environ.get("TESSERA_API_KEY", "").split(",")[0]
        self.metadata = (("authorization", f"Bearer {key}"),) if key else None

    async def __call__(self, sample: SampleRequest) -> RequestResult:
        result = RequestResult(prompt_len=sample.prompt_len)
        params = common_pb2.SamplingParams(temperature=0.0, max_tokens=sample.expected_output_len,
                                           ignore_eos=self.ignore_eos)
        timer = _Timer(result)
        try:
            async for message in self.stub.Generate(
                    frontend_pb2.GenerateRequest(text=sample.text(), sampling_params=params), metadata=self.metadata):
                if message.token_ids:
                    timer.chunk(message.text)
                if message.HasField("usage"):
                    result.prompt_len = message.usage.prompt_tokens
                    result.output_tokens = message.usage.completion_tokens
                    result.usage_reported = True
        except grpc.aio.AioRpcError as exc:
            result.error = f"{exc.code().name}: {exc.details()}"
            result.latency = time.perf_counter() - result.start
            return result
        timer.done()
        return result

    async def close(self) -> None:
        await self.channel.close()

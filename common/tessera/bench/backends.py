"""One streamed request per API, timed: OpenAI chat completions and completions over HTTP (any
OpenAI-compatible server), and tessera's gRPC Generate."""
from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from tessera.bench.datasets import SampleRequest

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
    """Timestamps of a request's token-bearing chunks. Against `vllm bench serve`'s (the same
    figures within noise, benchmarks/bench_crosscheck.py): its TTFT ends at the first chunk with
    choices, the role-only chunk that a server (tessera's, vLLM's) sends with the first token, ours
    at the first chunk with text; its latency ends at the last chunk with choices, ours after
    [DONE] (the usage chunk between: microseconds); its ITLs count the role chunk -> first text gap
    too. Both count output tokens from the server's usage.completion_tokens."""

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


def default_endpoint(chat: bool) -> str:
    return "/v1/chat/completions" if chat else "/v1/completions"


class OpenAIBackend:
    """POST {base_url}{endpoint} (default /v1/chat/completions or /v1/completions) with stream and
    include_usage; `headers` and `extra_body` added to every request, as vLLM's --header and
    --extra-body (the extra body last: it can replace any field, e.g. temperature)."""

    def __init__(self, client, base_url: str, model: str, chat: bool, ignore_eos: bool, *,
                 endpoint: str | None = None, headers: dict[str, str] | None = None,
                 extra_body: dict | None = None) -> None:
        self.client, self.model, self.chat, self.ignore_eos = client, model, chat, ignore_eos
        self.url = base_url.rstrip("/") + (endpoint or default_endpoint(chat))
        key = os.environ.get("OPENAI_API_KEY")
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.headers.update(headers or {})
        self.extra_body = dict(extra_body or {})

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
        body.update(self.extra_body)
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


def with_timeout(send: Sender, timeout_s: float | None) -> Sender:
    """`send` with a limit on each request's whole time (--request-timeout): a request still
    running after timeout_s seconds is cancelled (its stream closed) and counts as failed."""
    if timeout_s is None:
        return send

    async def timed(sample: SampleRequest) -> RequestResult:
        start = time.perf_counter()
        try:
            return await asyncio.wait_for(send(sample), timeout_s)
        except asyncio.TimeoutError:
            return RequestResult(prompt_len=sample.prompt_len, start=start, latency=time.perf_counter() - start,
                                 error=f"timed out after {timeout_s:g} s (--request-timeout)")

    return timed


class GrpcBackend:
    """tessera's FrontendService.Generate with the whole prompt as text, through tessera.client
    (the API key from TESSERA_API_KEY; no retries: a refused request is a measured failure)."""

    def __init__(self, addr: str, ignore_eos: bool) -> None:
        from tessera.client import AsyncClient  # tessera-client (the dev venv has it; the images do not bench)

        self.client = AsyncClient(addr, max_retries=0, timeout=None)
        self.ignore_eos = ignore_eos

    async def __call__(self, sample: SampleRequest) -> RequestResult:
        from tessera.client import TesseraError

        result = RequestResult(prompt_len=sample.prompt_len)
        timer = _Timer(result)
        try:
            async for delta in self.client.generate(prompt=sample.text(), temperature=0.0,
                                                    max_tokens=sample.expected_output_len,
                                                    ignore_eos=self.ignore_eos):
                if delta.token_ids:
                    timer.chunk(delta.text)
                if delta.usage is not None:
                    result.prompt_len = delta.usage.prompt_tokens
                    result.output_tokens = delta.usage.completion_tokens
                    result.usage_reported = True
        except TesseraError as exc:
            result.error = str(exc)  # "CODE: message"
            result.latency = time.perf_counter() - result.start
            return result
        timer.done()
        return result

    async def close(self) -> None:
        await self.client.close()

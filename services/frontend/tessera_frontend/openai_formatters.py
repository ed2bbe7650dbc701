"""OpenAI response bodies and stream chunks for /v1/chat/completions and /v1/completions.

A `Formatter` turns a request's `SampleOutput`s, each tagged with its choice index
across the request's prompts (`IndexedOutput`), into OpenAI's JSON: the whole
response (`response`), the stream's chunks (`stream_start`, `stream_chunks`) and the
final usage chunk (`usage_chunk`). `ChatFormatter` and `CompletionFormatter` differ in
the choice shape and the logprobs shape; finish reasons, vLLM's `stop_reason`, usage
and prompt logprobs are common. Nothing here knows about HTTP (that is `openai_api`).

With tools (a tool_choice other than none), `ChatFormatter` runs each choice's text through
`tool_calls`' parser: calls go out as the message's tool_calls (streamed: delta.tool_calls),
the rest as content, and a choice that stopped after making calls finishes "tool_calls".
"""
from __future__ import annotations

import time
from typing import NamedTuple

from tessera.v1 import common_pb2
from tessera_frontend.output_processor import SampleOutput
from tessera_frontend.tool_calls import ToolCall, ToolCallParser, ToolChoice, make_parser, parse_reply

LOGPROB_FLOOR = -9999.0  # JSON has no -inf; vLLM clamps the same way

FINISH_REASONS = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length",
                  common_pb2.FINISH_REASON_ABORT: "abort"}  # anything else finished reads "stop"


class IndexedOutput(NamedTuple):
    """One output of a request, with its choice index across the request's prompts (prompt * n + sample)."""
    index: int
    output: SampleOutput


class Usage:
    """Token counts summed over the request's prompts (each prompt's last output carries its usage)."""

    def __init__(self) -> None:
        self.prompt = self.completion = self.cached = 0

    def add(self, out: SampleOutput) -> None:
        if out.usage is not None:
            self.prompt += out.usage.prompt_tokens
            self.completion += out.usage.completion_tokens
            self.cached += out.usage.cached_prompt_tokens

    def as_dict(self) -> dict:
        return {"prompt_tokens": self.prompt, "completion_tokens": self.completion,
                "total_tokens": self.prompt + self.completion,
                "prompt_tokens_details": {"cached_tokens": self.cached}}


class _Choice:
    """One choice accumulated over its outputs (non-streamed responses)."""

    def __init__(self) -> None:
        self.text = ""
        self.logprobs: list[common_pb2.PositionLogprobs] = []
        self.prompt_logprobs: list[common_pb2.PositionLogprobs] | None = None
        self.finish: SampleOutput | None = None

    def add(self, out: SampleOutput) -> None:
        self.text += out.text
        self.logprobs.extend(out.logprobs)
        if out.prompt_logprobs:
            self.prompt_logprobs = out.prompt_logprobs
        if out.finished:
            self.finish = out


def _finish_fields(out: SampleOutput | None, called_tools: bool = False) -> dict:
    """finish_reason, and vLLM's stop_reason: the stop string or stop token id that ended it.
    A choice that made tool calls and stopped reads "tool_calls" (one cut short keeps "length")."""
    if out is None or not out.finished:
        return {"finish_reason": None, "stop_reason": None}
    stop_reason = out.stop_reason if out.stop_reason is not None else out.stop_token_id
    reason = FINISH_REASONS.get(out.finish_reason, "stop")
    if called_tools and reason == "stop":
        reason = "tool_calls"
    return {"finish_reason": reason, "stop_reason": stop_reason}


def _logprob(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


def _prompt_logprobs_json(positions: list[common_pb2.PositionLogprobs] | None) -> list | None:
    """vLLM's shape: per prompt token, None for the first, else {token id: {logprob, rank, decoded_token}}."""
    if positions is None:
        return None
    out: list = []
    for position in positions:
        if not position.HasField("chosen"):
            out.append(None)
            continue
        entry = {}
        for lp in (position.chosen, *position.top):
            entry[str(lp.token_id)] = {"logprob": _logprob(lp.logprob), "rank": lp.rank,
                                       "decoded_token": lp.token}
        out.append(entry)
    return out


class Formatter:
    """Builds one endpoint's response bodies and stream chunks."""

    object_name = ""   # of a whole response
    chunk_object = ""  # of a stream chunk
    id_prefix = ""

    def __init__(self, body, request_id: str, model: str) -> None:
        self.body = body
        self.id = f"{self.id_prefix}{request_id}"
        self.model = model
        self.created = int(time.time())

    def _envelope(self, choices: list[dict], obj: str | None = None) -> dict:
        return {"id": self.id, "object": obj or self.object_name, "created": self.created,
                "model": self.model, "choices": choices}

    def response(self, outputs: list[IndexedOutput], num_choices: int) -> dict:
        choices = [_Choice() for _ in range(num_choices)]
        usage = Usage()
        for item in outputs:
            choices[item.index].add(item.output)
            usage.add(item.output)
        body = self._envelope([self.choice_json(i, c) for i, c in enumerate(choices)])
        body["usage"] = usage.as_dict()
        return body

    def usage_chunk(self, usage: dict) -> dict:
        chunk = self._envelope([], self.chunk_object)
        chunk["usage"] = usage
        return chunk

    def _chunk(self, choice: dict) -> dict:
        chunk = self._envelope([choice], self.chunk_object)
        if self.body.include_usage:
            chunk["usage"] = None
        return chunk

    def stream_start(self) -> list[dict]:
        return []

    def choice_json(self, index: int, choice: _Choice) -> dict:
        raise NotImplementedError

    def stream_chunks(self, index: int, out: SampleOutput) -> list[dict]:
        raise NotImplementedError


class ChatFormatter(Formatter):
    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def __init__(self, body, request_id: str, model: str, tools: ToolChoice | None = None) -> None:
        super().__init__(body, request_id, model)
        self.tools = tools if tools is not None and tools.mode != "none" else None
        self._parsers: dict[int, ToolCallParser] = {}  # per streamed choice

    def _logprobs(self, positions: list[common_pb2.PositionLogprobs]) -> dict | None:
        if not self.body.logprobs:
            return None
        top_n = self.body.top_logprobs or 0

        def entry(lp: common_pb2.TokenLogprob) -> dict:
            return {"token": lp.token, "logprob": _logprob(lp.logprob), "bytes": list(lp.token.encode())}

        return {"content": [{**entry(p.chosen), "top_logprobs": [entry(t) for t in p.top[:top_n]]}
                            for p in positions]}

    def choice_json(self, index: int, choice: _Choice) -> dict:
        message: dict = {"role": "assistant", "content": choice.text}
        calls: list[ToolCall] = []
        if self.tools is not None:
            message["content"], calls = parse_reply(self.tools, choice.text)
            if calls:
                message["tool_calls"] = [call.as_json() for call in calls]
        out = {"index": index, "message": message, "logprobs": self._logprobs(choice.logprobs),
               **_finish_fields(choice.finish, bool(calls))}
        if self.body.prompt_logprobs is not None:
            out["prompt_logprobs"] = _prompt_logprobs_json(choice.prompt_logprobs)
        return out

    def stream_start(self) -> list[dict]:
        num_choices = self.body.n or 1
        return [self._chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}) for i in range(num_choices)]

    def stream_chunks(self, index: int, out: SampleOutput) -> list[dict]:
        if self.tools is not None:
            return self._tool_stream_chunks(index, out)
        if not (out.text or out.finished or (self.body.logprobs and out.logprobs)):
            return []  # tokens whose text is still held back (a partial UTF-8 character)
        choice = {"index": index, "delta": {"content": out.text} if out.text or not out.finished else {},
                  "logprobs": self._logprobs(out.logprobs), **_finish_fields(out)}
        return [self._chunk(choice)]

    def _tool_stream_chunks(self, index: int, out: SampleOutput) -> list[dict]:
        """A choice's chunks when tools are on: the content the parser lets out, then each call that
        completed, as a delta of its own. A call is sent whole (id, name and all its arguments in one
        delta.tool_calls entry) once its text is complete, rather than its arguments piece by piece:
        OpenAI's clients accumulate either the same way, and a whole call is never taken back."""
        parser = self._parsers.get(index)
        if parser is None:
            parser = self._parsers[index] = make_parser(self.tools)
        sent_before = parser.calls
        events = parser.feed(out.text)
        if out.finished:
            events += parser.finish()
        deltas: list[dict] = []
        content = "".join(e for e in events if isinstance(e, str))
        if content:
            deltas.append({"content": content})
        calls = [e for e in events if isinstance(e, ToolCall)]
        deltas += [{"tool_calls": [call.as_delta(sent_before + k)]} for k, call in enumerate(calls)]
        if not deltas:
            if not (out.finished or (self.body.logprobs and out.logprobs)):
                return []  # held back: it may still be (the start of) a call
            deltas.append({})
        unfinished = _finish_fields(None)
        return [self._chunk({"index": index, "delta": delta,
                             "logprobs": self._logprobs(out.logprobs) if i == 0 else None,
                             **(_finish_fields(out, parser.calls > 0) if i == len(deltas) - 1 else unfinished)})
                for i, delta in enumerate(deltas)]


class CompletionFormatter(Formatter):
    object_name = "text_completion"
    chunk_object = "text_completion"
    id_prefix = "cmpl-"

    def __init__(self, body, request_id: str, model: str) -> None:
        super().__init__(body, request_id, model)
        self._offsets: dict[int, int] = {}  # per choice: characters streamed so far (text_offset)

    def _logprobs(self, positions: list[common_pb2.PositionLogprobs], offset: int = 0) -> dict | None:
        if self.body.logprobs is None:
            return None
        tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
        for position in positions:
            chosen = position.chosen
            tokens.append(chosen.token)
            token_logprobs.append(_logprob(chosen.logprob))
            top = {chosen.token: _logprob(chosen.logprob)}
            for lp in position.top[:self.body.logprobs]:
                top.setdefault(lp.token, _logprob(lp.logprob))
            top_logprobs.append(top)
            text_offset.append(offset)
            offset += len(chosen.token)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": text_offset}

    def choice_json(self, index: int, choice: _Choice) -> dict:
        out = {"index": index, "text": choice.text, "logprobs": self._logprobs(choice.logprobs),
               **_finish_fields(choice.finish)}
        if self.body.prompt_logprobs is not None:
            out["prompt_logprobs"] = _prompt_logprobs_json(choice.prompt_logprobs)
        return out

    def stream_chunks(self, index: int, out: SampleOutput) -> list[dict]:
        if not (out.text or out.finished or (self.body.logprobs is not None and out.logprobs)):
            return []
        offset = self._offsets.get(index, 0)
        self._offsets[index] = offset + sum(len(p.chosen.token) for p in out.logprobs)
        return [self._chunk({"index": index, "text": out.text, "logprobs": self._logprobs(out.logprobs, offset),
                             **_finish_fields(out)})]

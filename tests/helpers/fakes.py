"""Fakes for the frontend's in-process tests: a tokenizer client whose detokenize stream turns
each token id into a fixed word (tests/frontend/test_output_processor.py, test_async_llm.py)."""
from __future__ import annotations

import asyncio
import dataclasses
import functools

import grpc

from tessera.v1 import common_pb2, tokenizer_pb2
from tessera_frontend.tokenizer_client import DetokenizeStreamError, TokenizeError

# The fake model's vocabulary: token id -> its text.
WORDS = ["<s>", "Hello", ",", " world", "!", " the", " end", " and", " more", " STOP", "</s>"]
EOS = len(WORDS) - 1


def ids(*words: str) -> list[int]:
    return [WORDS.index(w) for w in words]


def run_async(test):
    """Run an async test function in a fresh event loop."""
    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        return asyncio.run(test(*args, **kwargs))
    return wrapper


# -- the fake tokenizer client -------------------------------------------------------------------
@dataclasses.dataclass
class _Detok:
    open: tokenizer_pb2.DetokenizeOpen
    text: str = ""
    emitted: int = 0  # characters of `text` already sent as deltas


class FakeDetokenizeStream:
    """The DetokenizeStream as the processor sees it: send(items) -> future of results, cancel(keys)."""

    def __init__(self) -> None:
        self.generation = 1
        self.on_open: list = []
        self.sent: list[list[tokenizer_pb2.DetokenizeItem]] = []  # every message, in order
        self.cancelled: list[str] = []
        self.down = False            # send() raises DetokenizeStreamError
        self.answer_at_once = True   # else replies wait for answer()
        self.extra_result = False    # answer one result too many (a broken tokenizer)
        self._open: dict[str, _Detok] = {}
        self._unanswered: list[tuple[asyncio.Future, list]] = []

    @property
    def connected(self) -> bool:
        return not self.down

    def reconnect(self) -> None:
        """A new stream to a restarted tokenizer: it knows no request."""
        self.down = False
        self.generation += 1
        self._open.clear()
        for listener in self.on_open:
            listener()

    def send(self, items) -> asyncio.Future:
        if self.down:
            raise DetokenizeStreamError("the detokenize stream to the tokenizer is down")
        items = list(items)
        self.sent.append(items)
        results = [self._detokenize(item) for item in items]
        if self.extra_result:
            results.append(tokenizer_pb2.DetokenizeResult(request_id="?"))
        future = asyncio.get_running_loop().create_future()
        if self.answer_at_once:
            future.set_result(results)
        else:
            self._unanswered.append((future, results))
        return future

    def answer(self) -> None:
        """Answer every message sent so far, in order."""
        for future, results in self._unanswered:
            future.set_result(results)
        self._unanswered.clear()

    def cancel(self, keys) -> None:
        for key in keys:
            self.cancelled.append(key)
            self._open.pop(key, None)

    def is_open(self, key: str) -> bool:
        return key in self._open

    def _detokenize(self, item: tokenizer_pb2.DetokenizeItem) -> tokenizer_pb2.DetokenizeResult:
        if item.HasField("open"):
            resumed = "".join(WORDS[t] for t in item.open.resumed_token_ids)
            self._open[item.request_id] = _Detok(item.open, resumed, item.open.resumed_text_chars)
        state = self._open.get(item.request_id)
        if state is None:
            return tokenizer_pb2.DetokenizeResult(
                request_id=item.request_id,
                error=common_pb2.RequestError(code="NOT_FOUND", message="not open"))
        result = tokenizer_pb2.DetokenizeResult(request_id=item.request_id)
        for consumed, token_id in enumerate(item.new_token_ids, start=1):
            state.text += WORDS[token_id]
            for stop in state.open.stop:
                at = state.text.find(stop, state.emitted)
                if at >= 0:
                    end = at + len(stop) if state.open.include_stop_str_in_output else at
                    result.text_delta = state.text[state.emitted:end]
                    result.stop_matched = stop
                    result.tokens_consumed = consumed
                    result.finished = True
                    del self._open[item.request_id]
                    return result
        result.text_delta = state.text[state.emitted:]
        state.emitted = len(state.text)
        result.tokens_consumed = len(item.new_token_ids)
        if item.finished:
            result.finished = True
            del self._open[item.request_id]
        return result


class FakeTokenizerClient:
    """Stands in for TokenizerClient in-process: model info, tokenize, token texts, the detokenize stream."""

    def __init__(self, max_model_len: int = 64) -> None:
        self.stream = FakeDetokenizeStream()
        self.model_info: tokenizer_pb2.ModelInfo | None = tokenizer_pb2.ModelInfo(
            model_name="fake-model", vocab_size=len(WORDS), eos_token_ids=[EOS], max_model_len=max_model_len,
            has_chat_template=True)
        self.connected = True
        self.timeout_s = 30.0  # how long the processor keeps outputs the tokenizer could not take
        self.tokenized: list[tokenizer_pb2.TokenizeRequest] = []
        self.token_text_calls = 0

    def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def tokenize(self, request: tokenizer_pb2.TokenizeRequest, request_id: str) -> tokenizer_pb2.TokenizeResponse:
        """One token per word; a chat message is its role's token plus its words."""
        self.tokenized.append(request)
        if request.HasField("chat"):
            words = [w for m in request.chat.messages for w in (m.role, *m.content.split())]
        else:
            words = request.text.split()
        if "refuse" in words:
            raise TokenizeError(grpc.StatusCode.INVALID_ARGUMENT, "chat.messages[0].content: refused")
        return tokenizer_pb2.TokenizeResponse(token_ids=[1 + len(w) % (EOS - 1) for w in words])

    async def token_texts(self, token_ids) -> dict[int, str]:
        self.token_text_calls += 1
        return {t: WORDS[t] for t in token_ids}

"""One DetokenizeStream call's requests: incremental detokenization of many requests
multiplexed on one stream, one reply per inbound message (one engine step).

`DetokenizeSession.process` turns a DetokenizeStreamRequest into a DetokenizeStreamResponse:
it opens, steps, cancels and finishes each item's `IncrementalDetokenizer` (see
`detokenizer`), validates each item on its own (a bad one gets an error result, the rest
go on), and writes each request's one log line ("detokenize request ended") and outcome
metric when it ends. The gRPC plumbing (threads for big messages, stream metrics) stays in
`server`.
"""
from __future__ import annotations

import collections
import logging
import time
from typing import Callable

from tessera.common.logs import client_request_id
from tessera.v1 import tokenizer_pb2
from tessera_tokenizer import metrics
from tessera_tokenizer.detokenizer import IncrementalDetokenizer
from tessera_tokenizer.tokenizer import Tokenizer

log = logging.getLogger("tessera.tokenizer")


class InvalidItem(ValueError):
    """A bad stream item; the message names the field: "<field>: <what is wrong>"."""


class DetokenizeSession:
    """The requests of one DetokenizeStream call, by request id; gone when the stream ends.

    Every item gets exactly one result. A request id is opened by an item carrying
    `open`, or else by its first item (default options). `cancel` drops the request
    with no output; `finished` flushes held-back text and forgets it; a stop-string
    match ends it too (finished=true, stop_matched, tokens_consumed). Items that arrive
    without `open` for an id that ended here (stop string, error) get an empty
    finished result. A bad item gets a result with an error and finished=true and its
    request is dropped; the other items and requests are unaffected. The exception is
    `open` for an id that is already open: that item is refused, the open request
    goes on.
    """

    # How many ids ended here (stop string, error) are remembered, so that tokens the
    # engine generated before it was told to stop are ignored instead of opening the
    # id again.
    MAX_ENDED = 65_536

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, IncrementalDetokenizer] = {}
        self._vocab_size = tokenizer.vocab_size
        self._ended: collections.OrderedDict[str, None] = collections.OrderedDict()
        # per open request, for its log line: [opened (monotonic), tokens in, characters out]
        self._tally: dict[str, list] = {}

    def process(self, message: tokenizer_pb2.DetokenizeStreamRequest) -> tokenizer_pb2.DetokenizeStreamResponse:
        """One inbound message (one engine step) to one reply, results in item order."""
        response = tokenizer_pb2.DetokenizeStreamResponse()
        results = response.results
        add = results.add
        for i, item in enumerate(message.items):
            try:
                self._item(item, add)
            except InvalidItem as exc:
                del results[i:]  # (nothing was added for this item; keep it so)
                results.append(self._fail(item.request_id, "INVALID_ARGUMENT", str(exc)))
            except Exception as exc:  # a bug must not break the other requests on the stream
                log.exception("detokenize item failed", extra={"request_id": item.request_id})
                del results[i:]
                results.append(self._fail(item.request_id, "INTERNAL", f"internal error: {exc}"))
        return response

    def _item(self, item: tokenizer_pb2.DetokenizeItem, add: Callable[..., tokenizer_pb2.DetokenizeResult]) -> None:
        """Handle one item; its result is added (with `add`, in place) only once it is complete."""
        rid = item.request_id
        if not rid:
            raise InvalidItem("request_id: must not be empty")
        request = self.requests.get(rid)
        if item.cancel:
            if self.requests.pop(rid, None) is not None:
                self._log_end(rid, "cancel")
            add(request_id=rid, finished=True)
            return
        if item.HasField("open"):
            if request is not None:
                # The open request stays as it is; only this item is refused.
                add(request_id=rid, finished=True,
                    error={"code": "INVALID_ARGUMENT", "message": f"open: request id {rid!r} is already open"})
                return
            request = self._open(rid, item.open)
        elif request is None:
            if rid in self._ended:
                # Tokens generated after this request ended here (e.g. on a stop string).
                add(request_id=rid, finished=True)
                return
            request = self._open(rid, None)

        # A list: min/max/len/extend on the proto's repeated field cost far more.
        ids = item.new_token_ids[:]
        if ids and (min(ids) < 0 or max(ids) >= self._vocab_size):
            bad = self.tokenizer.first_invalid_id(ids)
            raise InvalidItem(f"new_token_ids: token id {bad} is out of range [0, {self.tokenizer.vocab_size})")
        out = request.step(ids, finished=item.finished)
        tally = self._tally[rid]
        tally[1] += len(ids)
        tally[2] += len(out.text)
        if out.finished:
            del self.requests[rid]
            if out.stop_matched is not None:
                self._remember_ended(rid)
            if out.stop_matched is None:
                self._log_end(rid, "finished")
            else:
                self._log_end(rid, "stop", stop_matched=out.stop_matched, tokens_consumed=out.tokens_consumed)
        # Built in place, setting only fields that differ from their defaults.
        result = add()
        result.request_id = rid
        if out.text:
            result.text_delta = out.text
        if out.stop_matched is not None:
            result.stop_matched = out.stop_matched
        if out.tokens_consumed:
            result.tokens_consumed = out.tokens_consumed
        if out.finished:
            result.finished = True

    def _open(self, rid: str, spec: tokenizer_pb2.DetokenizeOpen | None) -> IncrementalDetokenizer:
        if spec is None:
            request = IncrementalDetokenizer(self.tokenizer.backend)
        else:
            if any(not s for s in spec.stop):
                raise InvalidItem("open.stop: stop strings must not be empty")
            bad = self.tokenizer.first_invalid_id(spec.prompt_token_ids)
            if bad is not None:
                raise InvalidItem(
                    f"open.prompt_token_ids: token id {bad} is out of range [0, {self.tokenizer.vocab_size})")
            request = IncrementalDetokenizer(
                self.tokenizer.backend,
                stop=list(spec.stop),
                include_stop_str_in_output=spec.include_stop_str_in_output,
                skip_special_tokens=spec.skip_special_tokens if spec.HasField("skip_special_tokens") else True,
                prompt_token_ids=list(spec.prompt_token_ids),
                min_tokens=spec.min_tokens,
            )
            if spec.resumed_token_ids:
                resumed = spec.resumed_token_ids[:]
                bad = self.tokenizer.first_invalid_id(resumed)
                if bad is not None:
                    raise InvalidItem(f"open.resumed_token_ids: token id {bad} is out of range "
                                      f"[0, {self.tokenizer.vocab_size})")
                try:
                    request.resume(resumed, spec.resumed_text_chars)
                except ValueError as exc:
                    raise InvalidItem(f"open.resumed_token_ids: {exc}") from None
        self.requests[rid] = request
        self._tally[rid] = [time.monotonic(), 0, 0]
        self._ended.pop(rid, None)
        log.debug("detokenize request opened", extra={"request_id": client_request_id(rid),
                                                      "engine_request_id": rid})
        return request

    def _fail(self, rid: str, code: str, message: str) -> tokenizer_pb2.DetokenizeResult:
        """End request `rid` with an error result."""
        if rid:
            self.requests.pop(rid, None)
            self._remember_ended(rid)
        self._log_end(rid, "error", level=logging.WARNING, error_code=code, error=message)
        return tokenizer_pb2.DetokenizeResult(
            request_id=rid, finished=True, error={"code": code, "message": message})

    def close(self) -> None:
        """The stream ended: the requests still open end with it."""
        for rid in list(self.requests):
            self._log_end(rid, "stream_closed")
        self.requests.clear()

    def _log_end(self, rid: str, outcome: str, level: int = logging.INFO, **fields) -> None:
        """The request's one log line, and its outcome counted."""
        metrics.OUTCOMES[outcome].inc()
        tally = self._tally.pop(rid, None)
        line = {"request_id": client_request_id(rid), "engine_request_id": rid, "outcome": outcome}
        if tally is not None:
            line.update(tokens=tally[1], text_chars=tally[2], seconds=round(time.monotonic() - tally[0], 6))
        line.update((k, v) for k, v in fields.items() if v is not None)
        log.log(level, "detokenize request ended", extra=line)

    def _remember_ended(self, rid: str) -> None:
        self._ended[rid] = None
        self._ended.move_to_end(rid)
        while len(self._ended) > self.MAX_ENDED:
            self._ended.popitem(last=False)

"""Incremental detokenization of one streaming request: new token ids in, new text out.

Three parts, one job each:

- `IncrementalDecoder` turns a growing list of token ids into text deltas. Their
  concatenation always equals the full decode of the ids so far, except that an
  incomplete UTF-8 character at the end is held back (never emitted as U+FFFD) until a
  later token completes it or the request finishes; the text before it is emitted.
- `StopStringMatcher` watches the text for stop strings, even when one spans several
  tokens. It holds back text that might be the start of a stop string until that is
  decided, and cuts the text at the stop string (or after it, when the stop string is
  to be kept).
- `IncrementalDetokenizer` combines the two for one request, token by token, and says
  how many of the new tokens were consumed before a stop string completed.

How the decoder works (the prefix/read offsets of vLLM's detokenizer): it decodes a
short window of ids `ids[prefix:]` and compares it with the decode of `ids[prefix:read]`,
the part already emitted; the difference is the new text. Decoding a window that starts
a few tokens back, rather than the new token alone, keeps the context that decoders need
(e.g. sentencepiece drops a leading space only at the very start). Offsets only move to
points where the decode ended in a complete character, so every window starts on a
character boundary and decoding it gives exactly the matching part of the full decode.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Sequence

import tokenizers

_REPLACEMENT = "\ufffd"
# Prompt tokens decoded before the first generated token, for context.
_PROMPT_CONTEXT_TOKENS = 5
# Once the emitted part of the window is this many tokens long, the window moves up.
_WINDOW_TOKENS = 8


class IncrementalDecoder:
    """Token ids to text deltas, holding back incomplete UTF-8 characters."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        skip_special_tokens: bool = True,
        prompt_token_ids: Sequence[int] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._decode_ids = tokenizer.decode  # (ids, skip_special_tokens) -> str
        self._skip = skip_special_tokens
        # Only the window is kept: ids before it are dropped as it moves, so the window
        # always starts at ids[0] (a character boundary).
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._read = len(self._ids)      # ids[:read] are emitted (or prompt context)
        self._prefix_text = self._decode(self._ids)  # decode of ids[:read]
        # Characters emitted past `_prefix_text` while the window still ended in an
        # incomplete character (the complete text before it is already final).
        self._extra = 0

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids, self._skip)

    def step(self, token_ids: Sequence[int]) -> str:
        """Add new token ids; return the text they complete ("" when none yet)."""
        ids = self._ids
        ids.extend(token_ids)
        text = self._decode_ids(ids, self._skip)
        prefix_text = self._prefix_text
        if text[-1:] != _REPLACEMENT:
            # Complete: everything up to the end is emitted (the inline `_advance`).
            if text.startswith(prefix_text):
                delta = text[len(prefix_text) + self._extra:]
            else:
                delta = self._diverged(text)
            previous_read = self._read
            self._extra = 0
            if previous_read >= _WINDOW_TOKENS:
                # previous_read is a character boundary: restart the window there.
                del ids[:previous_read]
                self._read = len(ids)
                self._prefix_text = self._decode_ids(ids, self._skip)
            else:
                self._read = len(ids)
                self._prefix_text = text
            return delta
        # Text before a trailing incomplete character is final; the character is not yet.
        final = text.rstrip(_REPLACEMENT)
        delta = self._new_part(final)
        self._extra += len(delta)
        return delta

    def flush(self) -> str:
        """The text still held back (an incomplete character decodes to U+FFFD); call once at the end."""
        if self._read == len(self._ids):
            return ""
        text = self._decode(self._ids)
        delta = self._new_part(text)
        self._advance(text)
        return delta

    def _new_part(self, text: str) -> str:
        """The part of `text` (a decode of the window) not emitted yet."""
        if text.startswith(self._prefix_text):
            return text[len(self._prefix_text) + self._extra:]
        return self._diverged(text)

    def _diverged(self, text: str) -> str:
        # The emitted part decodes differently now: the prompt context ended inside a
        # character that the new tokens complete. Emit from where the two differ.
        return text[len(os.path.commonprefix([text, self._prefix_text])) + self._extra:]

    def _advance(self, text: str) -> None:
        """Everything up to the end is emitted; move the window up when it grew long."""
        previous_read, self._read = self._read, len(self._ids)
        self._extra = 0
        if previous_read >= _WINDOW_TOKENS:
            # previous_read is a character boundary: restart the window there.
            del self._ids[:previous_read]
            self._read -= previous_read
            self._prefix_text = self._decode(self._ids)
        else:
            self._prefix_text = text


class StopStringMatcher:
    """Finds stop strings in streamed text and decides how much text may be released.

    When several stop strings occur, the one that ends first wins (on a tie, the longer):
    that is the earliest point where the text contains a stop string, the same whatever
    pieces the text arrives in.
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        self.stops = tuple(dict.fromkeys(s for s in stop if s))
        self.include = include_stop_str_in_output
        self._max_len = max((len(s) for s in self.stops), default=0)
        # (stop, its length, its first character), for the searches
        self._specs = tuple((s, len(s), s[0]) for s in self.stops)
        self._text = ""       # recent text: unreleased, plus context for matches across pieces
        self._released = 0    # self._text[:released] has been released

    def feed(self, text: str, check: bool = True) -> tuple[str, str | None]:
        """Add text; return (text to release now, the stop string if one completed).

        With check=False the text may not complete a stop string (tokens inside the
        request's min_tokens), though a match may start in it and end in later text."""
        if not text or not self.stops:
            return text, None
        old_len = len(self._text)
        buf = self._text + text
        length = len(buf)
        # One pass over the stop strings finds the one that ends first among those the
        # new text completes and, in case none does, the longest end of the text that
        # could still start one (done in the same loop, to share the search).
        best_end = best_len = longest = 0
        best_stop = None
        hold = not self.include
        for stop, n, first in self._specs:
            # A match completed by the new text starts at or after `lo`; so does any
            # partial match. Neither can start before the first `first` from there.
            lo = old_len - n + 1
            if lo < 0:
                lo = 0
            i = buf.find(first, lo)
            if i == -1:
                continue
            start = buf.find(stop, i) if check else -1
            if start != -1:
                end = start + n
                if best_stop is None or end < best_end or (end == best_end and n > best_len):
                    best_end, best_len, best_stop = end, n, stop
            elif hold and best_stop is None:
                # Suffixes buf[j:] of a length in (longest, n - 1], earliest (longest) first.
                j = length - n + 1
                if j < i:
                    j = i
                hi = length - longest
                j = buf.find(first, j, hi)
                while j != -1:
                    if stop.startswith(buf[j:]):
                        longest = length - j
                        break
                    j = buf.find(first, j + 1, hi)
        released_to = self._released
        if best_stop is not None:
            end = best_end if self.include else best_end - best_len
            released = buf[released_to:end] if end > released_to else ""
            self._text, self._released = "", 0
            return released, best_stop
        release_to = length - longest
        if release_to < released_to:
            release_to = released_to
        released = buf[released_to:release_to]
        # Keep only what a later match could still need.
        keep_from = length - self._max_len + 1
        if keep_from > release_to:
            keep_from = release_to
        if keep_from > 0:
            self._text = buf[keep_from:]
            self._released = release_to - keep_from
        else:
            self._text = buf
            self._released = release_to
        return released, None

    def flush(self) -> str:
        """No more text will come: release what was held back."""
        released = self._text[self._released:]
        self._text, self._released = "", 0
        return released


@dataclasses.dataclass(frozen=True)
class DetokenizeOutput:
    """The outcome of one step of a request."""

    text: str                 # new text to show (a delta)
    stop_matched: str | None  # the stop string that ended the request, if one did
    tokens_consumed: int      # new token ids used; those after a stop string's end are dropped
    finished: bool            # no more output will come


def _output(text: str, stop_matched: str | None, tokens_consumed: int, finished: bool,
            _new=object.__new__, _cls=DetokenizeOutput) -> DetokenizeOutput:
    """A DetokenizeOutput, built without the frozen dataclass's `__init__` (one per token:
    its object.__setattr__ calls cost more than the rest of a step's bookkeeping)."""
    out = _new(_cls)
    fields = out.__dict__
    fields["text"] = text
    fields["stop_matched"] = stop_matched
    fields["tokens_consumed"] = tokens_consumed
    fields["finished"] = finished
    return out


class IncrementalDetokenizer:
    """Detokenizes one request's generated tokens, step by step, with stop strings."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
        prompt_token_ids: Sequence[int] = (),
        min_tokens: int = 0,
    ) -> None:
        self._decoder = IncrementalDecoder(tokenizer, skip_special_tokens, prompt_token_ids)
        self._stops = StopStringMatcher(stop, include_stop_str_in_output)
        # Stop strings count from the token after the first min_tokens (vLLM): the text of
        # the first min_tokens tokens cannot complete one.
        self._min_tokens = max(min_tokens, 0)
        self._num_tokens = 0  # tokens seen so far
        self.finished = False
        # After `resume`: text the replay released past what the client has (sent with the
        # next output), or characters the client has past it (dropped from the next outputs).
        # Both stay empty when the replay reproduces the first run, as it does.
        self._surplus = ""
        self._skip = 0

    def resume(self, token_ids: Sequence[int], text_chars: int) -> None:
        """Replay tokens detokenized elsewhere, of which the client has `text_chars` characters
        of text: the state (decoder window, held-back text, min_tokens count) is theirs, and
        their text is not emitted again. ValueError if a stop string completes in them."""
        out = self.step(token_ids)
        if out.finished:
            raise ValueError("a stop string completes in them: the request had ended")
        self._surplus = out.text[text_chars:]
        self._skip = max(0, text_chars - len(out.text))

    def _resumed(self, out: DetokenizeOutput) -> DetokenizeOutput:
        text = self._surplus + out.text
        self._surplus = ""
        if self._skip:
            cut = min(self._skip, len(text))
            text, self._skip = text[cut:], self._skip - cut
        return _output(text, out.stop_matched, out.tokens_consumed, out.finished)

    def step(self, token_ids: Sequence[int], finished: bool = False) -> DetokenizeOutput:
        """Add a step's new token ids; with `finished`, also flush everything held back."""
        if self._surplus or self._skip:
            return self._resumed(self._step(token_ids, finished))
        return self._step(token_ids, finished)

    def _step(self, token_ids: Sequence[int], finished: bool) -> DetokenizeOutput:
        if self.finished:
            return _output("", None, 0, True)
        stops = self._stops
        if not stops.stops:
            # No stop strings: the whole step decodes at once.
            text = self._decoder.step(token_ids) if token_ids else ""
            if finished:
                text += self._decoder.flush()
                self.finished = True
            return _output(text, None, len(token_ids), finished)

        decode, feed = self._decoder.step, stops.feed
        if len(token_ids) == 1 and self._num_tokens >= self._min_tokens:
            # The common case (one token per engine step, past min_tokens): no per-token loop.
            self._num_tokens += 1
            released, stop = feed(decode(token_ids))
            if stop is not None:
                self.finished = True
                return _output(released, stop, 1, True)
            if not finished:
                return _output(released, None, 1, False)
            pieces = [released]
        else:
            pieces = []
            for i, token_id in enumerate(token_ids):
                self._num_tokens += 1
                released, stop = feed(decode((token_id,)), self._num_tokens > self._min_tokens)
                pieces.append(released)
                if stop is not None:
                    self.finished = True
                    return _output("".join(pieces), stop, i + 1, True)
        if finished:
            # the held-back end belongs to the last token: checked only if that one was
            released, stop = feed(self._decoder.flush(), self._num_tokens > self._min_tokens)
            pieces.append(released)
            if stop is None:
                pieces.append(stops.flush())
            self.finished = True
            return _output("".join(pieces), stop, len(token_ids), True)
        return _output("".join(pieces), None, len(token_ids), False)

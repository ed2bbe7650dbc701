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
        self._skip = skip_special_tokens
        # Only the window is kept: ids before `_prefix` are dropped as it moves.
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix = 0                 # window start (a character boundary)
        self._read = len(self._ids)      # ids[:read] are emitted (or prompt context)
        self._prefix_text = self._decode(self._ids)  # decode of ids[prefix:read]
        # Characters emitted past `_prefix_text` while the window still ended in an
        # incomplete character (the complete text before it is already final).
        self._extra = 0

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def step(self, token_ids: Sequence[int]) -> str:
        """Add new token ids; return the text they complete ("" when none yet)."""
        self._ids.extend(token_ids)
        text = self._decode(self._ids[self._prefix:])
        complete = not text.endswith(_REPLACEMENT)
        # Text before a trailing incomplete character is final; the character is not yet.
        final = text if complete else text.rstrip(_REPLACEMENT)
        delta = self._new_part(final)
        if complete:
            self._advance(text)
        else:
            self._extra += len(delta)
        return delta

    def flush(self) -> str:
        """The text still held back (an incomplete character decodes to U+FFFD); call once at the end."""
        if self._read == len(self._ids):
            return ""
        text = self._decode(self._ids[self._prefix:])
        delta = self._new_part(text)
        self._advance(text)
        return delta

    def _new_part(self, text: str) -> str:
        """The part of `text` (a decode of the window) not emitted yet."""
        if text.startswith(self._prefix_text):
            return text[len(self._prefix_text) + self._extra:]
        # The emitted part decodes differently now: the prompt context ended inside a
        # character that the new tokens complete. Emit from where the two differ.
        return text[len(os.path.commonprefix([text, self._prefix_text])) + self._extra:]

    def _advance(self, text: str) -> None:
        """Everything up to the end is emitted; move the window up when it grew long."""
        previous_read, self._read = self._read, len(self._ids)
        self._extra = 0
        if previous_read - self._prefix >= _WINDOW_TOKENS:
            # previous_read is a character boundary: restart the window there.
            del self._ids[:previous_read]
            self._read -= previous_read
            self._prefix = 0
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
        self._text = ""       # recent text: unreleased, plus context for matches across pieces
        self._released = 0    # self._text[:released] has been released

    def feed(self, text: str) -> tuple[str, str | None]:
        """Add text; return (text to release now, the stop string if one completed)."""
        if not self.stops or not text:
            return text, None
        old_len = len(self._text)
        self._text += text
        match = self._find(old_len)
        if match is not None:
            start, stop = match
            end = start + len(stop) if self.include else start
            released = self._text[self._released:max(end, self._released)]
            self._text, self._released = "", 0
            return released, stop
        hold = 0 if self.include else self._partial_match_len()
        release_to = max(len(self._text) - hold, self._released)
        released = self._text[self._released:release_to]
        # Keep only what a later match could still need.
        keep_from = max(0, min(release_to, len(self._text) - self._max_len + 1))
        self._text = self._text[keep_from:]
        self._released = release_to - keep_from
        return released, None

    def flush(self) -> str:
        """No more text will come: release what was held back."""
        released = self._text[self._released:]
        self._text, self._released = "", 0
        return released

    def _find(self, old_len: int) -> tuple[int, str] | None:
        """(start, stop) of the stop string that ends first among those completed by new text."""
        best: tuple[int, int, str] | None = None  # (end, -len, stop)
        for stop in self.stops:
            start = self._text.find(stop, max(0, old_len - len(stop) + 1))
            if start != -1:
                key = (start + len(stop), -len(stop), stop)
                if best is None or key < best:
                    best = key
        if best is None:
            return None
        end, neg_len, stop = best
        return end + neg_len, stop

    def _partial_match_len(self) -> int:
        """Length of the longest end of the text that is a proper prefix of a stop string."""
        text = self._text
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest


@dataclasses.dataclass(frozen=True)
class DetokenizeOutput:
    """The outcome of one step of a request."""

    text: str                 # new text to show (a delta)
    stop_matched: str | None  # the stop string that ended the request, if one did
    tokens_consumed: int      # new token ids used; those after a stop string's end are dropped
    finished: bool            # no more output will come


class IncrementalDetokenizer:
    """Detokenizes one request's generated tokens, step by step, with stop strings."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
        prompt_token_ids: Sequence[int] = (),
    ) -> None:
        self._decoder = IncrementalDecoder(tokenizer, skip_special_tokens, prompt_token_ids)
        self._stops = StopStringMatcher(stop, include_stop_str_in_output)
        self.finished = False

    def step(self, token_ids: Sequence[int], finished: bool = False) -> DetokenizeOutput:
        """Add a step's new token ids; with `finished`, also flush everything held back."""
        if self.finished:
            return DetokenizeOutput("", None, 0, True)
        if not self._stops.stops:
            # No stop strings: the whole step decodes at once.
            text = self._decoder.step(token_ids) if token_ids else ""
            if finished:
                text += self._decoder.flush()
                self.finished = True
            return DetokenizeOutput(text, None, len(token_ids), finished)

        pieces: list[str] = []
        for i, token_id in enumerate(token_ids):
            released, stop = self._stops.feed(self._decoder.step((token_id,)))
            pieces.append(released)
            if stop is not None:
                self.finished = True
                return DetokenizeOutput("".join(pieces), stop, i + 1, True)
        if finished:
            released, stop = self._stops.feed(self._decoder.flush())
            pieces.append(released)
            if stop is None:
                pieces.append(self._stops.flush())
            self.finished = True
            return DetokenizeOutput("".join(pieces), stop, len(token_ids), True)
        return DetokenizeOutput("".join(pieces), None, len(token_ids), False)

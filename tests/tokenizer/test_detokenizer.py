"""Unit tests of tessera_tokenizer.detokenizer against the real default tokenizer (SmolLM2 GGUF).

The properties checked:
- the concatenated text deltas equal the full decode of the ids so far after every step,
  less a trailing incomplete character (U+FFFD in the full decode), and exactly at the end;
- no delta contains U+FFFD for valid text;
- stop strings are found across token boundaries, the text is cut before them (or after,
  with include_stop_str_in_output), text that might start a stop string is held back
  until decided, and the result does not depend on how the tokens are split into steps.
"""
from __future__ import annotations

import json
import os

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tessera_tokenizer.detokenizer import IncrementalDecoder, IncrementalDetokenizer, StopStringMatcher
from tessera_tokenizer.tokenizer import Tokenizer

pytestmark = pytest.mark.unit

REPLACEMENT = "\ufffd"
# More examples for a deeper run: TESSERA_HYPOTHESIS_EXAMPLES=5000 pytest ...
EXAMPLES = int(os.environ.get("TESSERA_HYPOTHESIS_EXAMPLES", "150"))

SAMPLES = [
    "Hello, world!",
    "Héllo wörld, naïve café, crème brûlée, Ångström, São Paulo, Łódź",
    "中文测试：你好，世界！日本語のテキスト、한국어 텍스트",
    "Emoji: 😀🎉👍🏽 👨‍👩‍👧‍👦 🇫🇷🇯🇵 ❤️ done",
    "Mixed: résumé 東京 🚀 Ελληνικά русский العربية עברית हिन्दी",
    "  leading spaces, tabs\t\tand\nnew\nlines\n\n",
    "def f(x):\n    return {'a': [1, 2, 3]}  # code ≠ prose\n",
    "math: ∑ᵢ xᵢ² ≤ ∞, ½ ⅓ ¼, ℝⁿ → ℂ",
]

# Text for hypothesis: letters from several scripts, digits, punctuation, emoji.
TEXT = st.text(
    alphabet=st.one_of(
        st.characters(min_codepoint=0x20, max_codepoint=0x7E),
        st.sampled_from(list("éèêëçñßøåäöüÅÉ中文字世界日本語한국어русскийΕλληνικά😀🎉👍🏽🚀❤️\n\t ")),
        st.characters(blacklist_categories=("Cs", "Cc"), blacklist_characters=REPLACEMENT),
    ),
    max_size=60,
)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.load(None)


def feed(detok: IncrementalDetokenizer, ids: list[int], chunks: list[int] | None = None, finish: bool = True):
    """Feed `ids` in steps of the given sizes (default one token); return the outputs."""
    outputs, pos, sizes = [], 0, list(chunks or [])
    while pos < len(ids):
        size = max(1, sizes.pop(0)) if sizes else 1
        outputs.append(detok.step(ids[pos:pos + size]))
        pos += size
        if outputs[-1].finished:
            return outputs
    if finish:
        outputs.append(detok.step([], finished=True))
    return outputs


# --- the tokenizer the detokenizer runs on --------------------------------------------------

def test_model_info(tok):
    info = tok.info
    assert info.vocab_size == 49152 and info.bos_token_id == 1 and info.eos_token_ids == (2,)
    assert info.max_model_len == 8192 and info.has_chat_template
    assert info.special_tokens[:3] == ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def test_long_text_gives_what_the_plain_calls_give(tok):
    text = " ".join(SAMPLES) * 40  # long enough for the GIL-releasing batch calls
    long = tok.encode(text, return_offsets=True)
    plain = tok.backend.encode(text)
    assert long.ids == plain.ids and long.offsets == plain.offsets
    assert tok.decode(long.ids) == tok.backend.decode(long.ids) == text


def test_hf_directory(tok, tmp_path):
    """An HF model directory: tokenizer files, config.json, generation_config.json."""
    tok.hf.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "llama", "max_position_embeddings": 2048, "eos_token_id": 2}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    hf_dir = Tokenizer.load(str(tmp_path))
    assert hf_dir.info.max_model_len == 2048
    assert hf_dir.info.eos_token_ids == (2, 0)
    assert hf_dir.info.model_name == tmp_path.name
    assert hf_dir.info.vocab_size == tok.info.vocab_size
    assert hf_dir.info.special_tokens == tok.info.special_tokens
    for text in SAMPLES:
        assert hf_dir.encode(text).ids == tok.encode(text).ids
    messages = [{"role": "user", "content": "hi"}]
    assert hf_dir.render_chat(messages) == tok.render_chat(messages)


def test_torch_free_gguf_tokenizer_matches_transformers(tok):
    """Our GGUF loading (no torch) builds the same tokenizer as transformers' own loader (needs torch)."""
    pytest.importorskip("torch")
    from transformers import AutoTokenizer

    from tessera.common.model_source import resolve_model

    source = resolve_model(None)
    ref = AutoTokenizer.from_pretrained(str(source.directory), gguf_file=source.gguf_file)
    assert ref.backend_tokenizer.to_str() == tok.backend.to_str()
    for text in SAMPLES:
        assert tok.encode(text).ids == ref(text).input_ids
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    for prompt in (True, False):
        assert tok.render_chat(messages, prompt) == ref.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=prompt)


# --- incremental decoding ---------------------------------------------------------------

@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip_one_token_at_a_time(tok, text):
    ids = tok.encode(text).ids
    detok = IncrementalDetokenizer(tok.backend)
    outputs = feed(detok, ids)
    assert "".join(o.text for o in outputs) == text
    assert all(REPLACEMENT not in o.text for o in outputs)
    assert outputs[-1].finished and detok.finished


def test_multibyte_character_is_held_until_complete(tok):
    ids = tok.encode("世").ids
    assert len(ids) >= 2, "the test needs a character split over tokens"
    decoder = IncrementalDecoder(tok.backend)
    deltas = [decoder.step([i]) for i in ids]
    assert deltas[:-1] == [""] * (len(ids) - 1)
    assert deltas[-1] == "世"


def test_flush_emits_incomplete_character_as_replacement(tok):
    ids = tok.encode("a世").ids[:-1]  # cut the character short
    detok = IncrementalDetokenizer(tok.backend)
    outputs = feed(detok, ids)
    assert "".join(o.text for o in outputs) == tok.decode(ids)
    assert tok.decode(ids).endswith(REPLACEMENT)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), skip_special=st.booleans(), source=st.sampled_from(["text", "random", "mixed"]))
def test_deltas_equal_full_decode_at_every_prefix(tok, data, skip_special, source):
    vocab = tok.vocab_size
    random_ids = st.lists(st.one_of(st.integers(0, vocab - 1), st.integers(0, 20)), max_size=40)
    if source == "text":
        ids = tok.encode(data.draw(TEXT, label="text")).ids
    elif source == "random":
        ids = data.draw(random_ids, label="ids")
    else:
        ids = tok.encode(data.draw(TEXT, label="text")).ids
        ids[data.draw(st.integers(0, len(ids)), label="at"):0] = data.draw(random_ids, label="ids")
    chunks = data.draw(st.lists(st.integers(1, 4), max_size=len(ids)), label="chunks")

    detok = IncrementalDetokenizer(tok.backend, skip_special_tokens=skip_special)
    emitted, pos, sizes = "", 0, list(chunks)
    while pos < len(ids):
        step_ids = ids[pos:pos + (sizes.pop(0) if sizes else 1)]
        pos += len(step_ids)
        out = detok.step(step_ids)
        assert out.tokens_consumed == len(step_ids) and not out.finished
        emitted += out.text
        full = tok.decode(ids[:pos], skip_special)
        # Everything but a trailing incomplete character (or invalid bytes not yet
        # followed by valid text) is out at once.
        assert emitted == full.rstrip(REPLACEMENT)
    emitted += detok.step([], finished=True).text
    assert emitted == tok.decode(ids, skip_special)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt=TEXT, completion=st.lists(st.integers(0, 49151), max_size=20), skip_special=st.booleans())
def test_prompt_context_gives_text_after_the_prompt(tok, prompt, completion, skip_special):
    prompt_ids = tok.encode(prompt).ids
    prompt_text = tok.decode(prompt_ids, skip_special)
    full = tok.decode(prompt_ids + completion, skip_special)
    assume(full.startswith(prompt_text))
    detok = IncrementalDetokenizer(tok.backend, skip_special_tokens=skip_special, prompt_token_ids=prompt_ids)
    emitted = "".join(o.text for o in feed(detok, completion))
    assert emitted == full[len(prompt_text):]


def test_prompt_context_keeps_the_leading_space(tok):
    detok = IncrementalDetokenizer(tok.backend, prompt_token_ids=tok.encode("Hello").ids)
    ids = tok.encode(" world").ids
    assert "".join(o.text for o in feed(detok, ids)) == " world"


def test_prompt_cut_inside_a_character(tok):
    ids = tok.encode("a世").ids
    prompt, completion = ids[:-1], ids[-1:]
    assert tok.decode(prompt).endswith(REPLACEMENT)
    detok = IncrementalDetokenizer(tok.backend, prompt_token_ids=prompt)
    assert "".join(o.text for o in feed(detok, completion)) == "世"


def test_skip_special_tokens(tok):
    ids = tok.encode("<|im_start|>assistant\nHi<|im_end|>").ids
    kept = "".join(o.text for o in feed(IncrementalDetokenizer(tok.backend, skip_special_tokens=False), ids))
    dropped = "".join(o.text for o in feed(IncrementalDetokenizer(tok.backend), ids))
    assert kept == "<|im_start|>assistant\nHi<|im_end|>"
    assert dropped == "assistant\nHi"


def test_long_sequence_matches_full_decode(tok):
    text = " ".join(SAMPLES) * 5
    ids = tok.encode(text).ids
    detok = IncrementalDetokenizer(tok.backend)
    assert "".join(o.text for o in feed(detok, ids, chunks=[1, 2, 3, 5, 8] * 200)) == text


def test_steps_after_finish_are_empty(tok):
    detok = IncrementalDetokenizer(tok.backend)
    detok.step(tok.encode("done").ids, finished=True)
    out = detok.step(tok.encode("more").ids)
    assert out.finished and out.text == "" and out.tokens_consumed == 0


# --- stop strings -------------------------------------------------------------------------

SENTENCE = "The quick brown fox jumps over the lazy dog."


def token_texts(tok, text):
    ids = tok.encode(text).ids
    return ids, [tok.decode([i]) for i in ids]


@pytest.mark.parametrize("span", [1, 2, 3])
def test_stop_string_spanning_tokens(tok, span):
    ids, pieces = token_texts(tok, SENTENCE)
    assert pieces[2] == " brown"
    stop = "".join(pieces[2:2 + span])          # " brown", " brown fox", " brown fox jumps"
    for include in (False, True):
        detok = IncrementalDetokenizer(tok.backend, stop=[stop], include_stop_str_in_output=include)
        outputs = feed(detok, ids, finish=False)
        last = outputs[-1]
        assert last.finished and last.stop_matched == stop
        assert len(outputs) == 2 + span  # stopped at the token that completed the stop string
        expected = "The quick" + (stop if include else "")
        assert "".join(o.text for o in outputs) == expected


def test_stop_string_inside_tokens_and_tokens_consumed(tok):
    ids, pieces = token_texts(tok, SENTENCE)
    stop = "rown fo"  # starts inside " brown", ends inside " fox"
    detok = IncrementalDetokenizer(tok.backend, stop=[stop])
    out = detok.step(ids)  # the whole sentence in one step
    assert out.stop_matched == stop and out.finished
    assert out.tokens_consumed == 4  # The, quick, brown, fox
    assert out.text == "The quick b"
    detok = IncrementalDetokenizer(tok.backend, stop=[stop], include_stop_str_in_output=True)
    assert detok.step(ids).text == "The quick brown fo"


@pytest.mark.parametrize("one_step", [False, True])
def test_stop_strings_count_only_after_min_tokens(tok, one_step):
    """vLLM's rule: the text of the first min_tokens tokens cannot complete a stop string."""
    text = "the cat and the dog and the bird"
    ids, pieces = token_texts(tok, text)
    assert pieces[:4] == ["the", " cat", " and", " the"]

    def run(min_tokens):
        detok = IncrementalDetokenizer(tok.backend, stop=[" and"], min_tokens=min_tokens)
        outputs = [detok.step(ids)] if one_step else feed(detok, ids, finish=False)
        return "".join(o.text for o in outputs), outputs[-1]

    out_text, last = run(0)
    assert out_text == "the cat" and last.stop_matched == " and"
    # " and" is the 3rd token: with min_tokens 3 it cannot stop there; the next " and" does
    out_text, last = run(3)
    assert out_text == "the cat and the dog" and last.stop_matched == " and"
    assert last.tokens_consumed == (6 if one_step else 1)
    out_text, last = run(2)  # the 3rd token is the first checked one
    assert out_text == "the cat" and last.stop_matched == " and"
    out_text, last = run(len(ids))  # never checked: all text, unfinished
    assert out_text == text and last.stop_matched is None and not last.finished


def test_a_stop_string_may_start_inside_min_tokens(tok):
    ids, pieces = token_texts(tok, SENTENCE)
    stop = " brown fox"  # tokens 3 and 4
    detok = IncrementalDetokenizer(tok.backend, stop=[stop], min_tokens=3)
    outputs = feed(detok, ids, finish=False)
    assert outputs[-1].stop_matched == stop and len(outputs) == 4
    assert "".join(o.text for o in outputs) == "The quick"
    # ending inside the window does not count, even when the step ends the request
    detok = IncrementalDetokenizer(tok.backend, stop=[" brown"], min_tokens=3)
    out = detok.step(ids[:3], finished=True)
    assert out.stop_matched is None and out.text == "The quick brown" and out.finished


def test_partial_match_is_held_back_then_released(tok):
    ids, pieces = token_texts(tok, "The quick brown fox walks away")
    detok = IncrementalDetokenizer(tok.backend, stop=[" fox jumps"])
    texts = [detok.step([i]).text for i in ids[:4]]
    assert texts == ["The", " quick", " brown", ""]  # " fox" might start the stop string
    out = detok.step([ids[4]])                     # " walks": it did not
    assert out.text == " fox walks" and out.stop_matched is None and not out.finished
    rest = detok.step(ids[5:], finished=True)
    assert rest.text == " away" and rest.finished and rest.stop_matched is None


def test_held_back_text_is_released_on_finish(tok):
    ids = tok.encode("It ends with STO").ids
    detok = IncrementalDetokenizer(tok.backend, stop=["STOP"])
    outputs = feed(detok, ids, finish=False)
    assert "".join(o.text for o in outputs) == "It ends with "
    final = detok.step([], finished=True)
    assert final.text == "STO" and final.finished and final.stop_matched is None


def test_include_stop_str_holds_nothing_back(tok):
    ids, pieces = token_texts(tok, SENTENCE)
    detok = IncrementalDetokenizer(tok.backend, stop=[" fox jumps"], include_stop_str_in_output=True)
    assert [detok.step([i]).text for i in ids[:4]] == pieces[:4]


def test_earliest_ending_stop_string_wins(tok):
    ids = tok.encode(SENTENCE).ids
    out = IncrementalDetokenizer(tok.backend, stop=["brown fox jumps", "fox"]).step(ids)
    assert out.stop_matched == "fox" and out.text == "The quick brown "
    out = IncrementalDetokenizer(tok.backend, stop=["x", "fox"]).step(ids)
    assert out.stop_matched == "fox"  # same end: the longer one


def test_stop_string_at_the_very_start(tok):
    ids = tok.encode("Stop right there").ids
    out = IncrementalDetokenizer(tok.backend, stop=["Stop"]).step(ids)
    assert out.text == "" and out.stop_matched == "Stop" and out.tokens_consumed == 1


def test_stop_string_with_multibyte_characters(tok):
    text = "价格是 😀 很好，谢谢"
    ids = tok.encode(text).ids
    outputs = feed(IncrementalDetokenizer(tok.backend, stop=["😀 很"]), ids, finish=False)
    assert outputs[-1].stop_matched == "😀 很"
    assert "".join(o.text for o in outputs) == "价格是 "


def reference_stop(text: str, stops: list[str]) -> tuple[str, int, int] | None:
    """(stop, start, end) of the stop string that ends first in `text` (longer on a tie)."""
    best = None
    for s in stops:
        i = text.find(s)
        if i != -1 and (best is None or (i + len(s), -len(s)) < (best[2], -len(best[0]))):
            best = (s, i, i + len(s))
    return best


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), include=st.booleans())
def test_stop_strings_property(tok, data, include):
    text = data.draw(TEXT.filter(lambda t: len(t) >= 2), label="text")
    ids = tok.encode(text).ids
    assume(tok.decode(ids) == text)
    substrings = st.builds(lambda a, n: text[a:a + n], st.integers(0, len(text) - 1), st.integers(1, 6))
    stops = data.draw(st.lists(st.one_of(substrings, st.text(min_size=1, max_size=4)), min_size=1, max_size=3),
                      label="stops")
    chunks = data.draw(st.lists(st.integers(1, 5), max_size=len(ids)), label="chunks")

    detok = IncrementalDetokenizer(tok.backend, stop=stops, include_stop_str_in_output=include)
    outputs = feed(detok, ids, chunks)
    emitted = "".join(o.text for o in outputs)
    assert REPLACEMENT not in emitted
    match = reference_stop(text, stops)
    if match is None:
        assert emitted == text and outputs[-1].stop_matched is None
        return
    stop, start, end = match
    assert outputs[-1].stop_matched == stop and outputs[-1].finished
    assert emitted == text[:end if include else start]
    # Tokens consumed: up to the first token whose text completes the stop string.
    needed = next(k for k in range(1, len(ids) + 1) if len(tok.decode(ids[:k]).rstrip(REPLACEMENT)) >= end)
    assert sum(o.tokens_consumed for o in outputs) == needed
    # Every step released only text that is final.
    released = ""
    for o in outputs:
        released += o.text
        assert text.startswith(released)


# --- the stop string matcher alone ---------------------------------------------------------

def test_matcher_char_by_char_equals_all_at_once():
    text = "say abracadabra, then stop"
    stops = ["cadab", "abra,", "then s"]
    whole = StopStringMatcher(stops)
    released, match = whole.feed(text)
    piecewise, out, pm = StopStringMatcher(stops), "", None
    for ch in text:
        r, pm = piecewise.feed(ch)
        out += r
        if pm:
            break
    assert match == pm == "cadab"
    assert released == out == "say abra"


def test_matcher_releases_held_text_when_the_match_fails():
    m = StopStringMatcher(["<end>"])
    assert m.feed("abc<e") == ("abc", None)
    assert m.feed("n") == ("", None)
    assert m.feed("x") == ("<enx", None)
    assert m.flush() == ""


def test_matcher_ignores_empty_and_duplicate_stops():
    m = StopStringMatcher(["", "a", "a"])
    assert m.stops == ("a",)
    assert StopStringMatcher([""]).feed("text") == ("text", None)


def test_matcher_partial_match_with_repeated_characters():
    # "aaa" ends with "aa", a prefix of "aab": only the first "a" can go.
    m = StopStringMatcher(["aab"])
    assert [m.feed(ch) for ch in "aaa"] == [("", None), ("", None), ("a", None)]
    assert m.feed("b") == ("", "aab")
    assert StopStringMatcher(["aab"]).feed("aaab") == ("a", "aab")
    assert StopStringMatcher(["aab"], include_stop_str_in_output=True).feed("aaab") == ("aaab", "aab")
    m = StopStringMatcher(["aab"])
    assert m.feed("aaa") == ("a", None)
    assert m.feed("c") == ("aac", None)  # the match failed: all of it goes
    m = StopStringMatcher(["abab"])
    assert m.feed("xabaaba") == ("xaba", None)  # "aba" could still start "abab"; "abaaba" cannot
    assert m.feed("b") == ("", "abab")


def test_matcher_holds_the_longest_partial_match_of_several_stops():
    m = StopStringMatcher(["abcd", "bce", "cx"])
    assert m.feed("zabc") == ("z", None)    # "abc" could start "abcd" ("bc": "bce", "c": "cx")
    assert m.feed("e") == ("a", "bce")      # "bce" completed: cut before it
    m = StopStringMatcher(["abcd", "bce", "cx"])
    assert m.feed("zabc") == ("z", None)
    assert m.feed("y") == ("abcy", None)   # no stop string can start in "abcy" any more
    m = StopStringMatcher(["xyz", "x"])
    assert m.feed("ax") == ("a", "x")       # "x" is complete at once; "xyz" never ends first
    m = StopStringMatcher(["bcd", "abcde"], include_stop_str_in_output=True)
    assert m.feed("abcde") == ("abcd", "bcd")  # the one that ends first wins


def reference_matcher_run(stops: list[str], include: bool, pieces: list[str]) -> list[tuple[str, str | None]]:
    """What StopStringMatcher.feed should return for each piece, worked out from the whole text so far."""
    stops = [s for s in stops if s]
    text, released, out = "", 0, []
    for piece in pieces:
        text += piece
        match = reference_stop(text, stops) if piece else None
        if match is not None:
            stop, start, end = match
            cut = end if include else start
            out.append((text[released:max(cut, released)], stop))
            return out
        hold = 0
        if not include:
            hold = max((n for s in stops for n in range(1, min(len(s), len(text) + 1))
                        if text.endswith(s[:n])), default=0)
        release_to = max(len(text) - hold, released)
        out.append((text[released:release_to], None))
        released = release_to
    out.append((text[released:], "<flush>"))
    return out


@settings(max_examples=EXAMPLES * 4, deadline=None)
@given(stops=st.lists(st.text(alphabet="ab<", min_size=1, max_size=5), min_size=1, max_size=4),
       pieces=st.lists(st.text(alphabet="ab<c", max_size=4), max_size=12), include=st.booleans())
def test_matcher_equals_the_reference_on_repetitive_text(stops, pieces, include):
    m = StopStringMatcher(stops, include_stop_str_in_output=include)
    got = []
    for piece in pieces:
        got.append(m.feed(piece))
        if got[-1][1] is not None:
            break
    else:
        got.append((m.flush(), "<flush>"))
    assert got == reference_matcher_run(stops, include, pieces)


# --- resuming on another stream ------------------------------------------------------------

@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), include=st.booleans(), min_tokens=st.integers(0, 3))
def test_a_resumed_request_continues_its_text_exactly(tok, data, include, min_tokens):
    """Cut a run anywhere: a new detokenizer resumed with the tokens before the cut and the
    characters the client got from them emits exactly what the first one went on to emit."""
    text = data.draw(TEXT.filter(lambda t: len(t) >= 2), label="text")
    ids = tok.encode(text).ids
    prompt = tok.encode("Once upon a time").ids
    stops = data.draw(st.lists(st.text(min_size=1, max_size=3), max_size=2), label="stops")
    options = dict(stop=stops, include_stop_str_in_output=include, prompt_token_ids=prompt, min_tokens=min_tokens)
    whole = feed(IncrementalDetokenizer(tok.backend, **options), ids)
    ended_at = sum(o.tokens_consumed for o in whole)  # a stop string may end it early
    cut = data.draw(st.integers(0, max(0, min(ended_at, len(ids)) - 1)), label="cut")
    first = IncrementalDetokenizer(tok.backend, **options)
    before = feed(first, ids[:cut], finish=False)
    assert not any(o.finished for o in before)
    got = "".join(o.text for o in before)

    resumed = IncrementalDetokenizer(tok.backend, **options)
    resumed.resume(ids[:cut], len(got))
    after = feed(resumed, ids[cut:])
    assert got + "".join(o.text for o in after) == "".join(o.text for o in whole)
    assert after[-1].stop_matched == whole[-1].stop_matched


def test_resuming_past_a_stop_string_is_refused(tok):
    ids = tok.encode("one two three").ids
    detok = IncrementalDetokenizer(tok.backend, stop=["two"])
    with pytest.raises(ValueError, match="stop string"):
        detok.resume(ids, 4)

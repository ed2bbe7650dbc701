"""tessera.bench.datasets' custom dataset (vLLM's JSONL format): reading, choosing as vLLM's
CustomDataset does, lengths counted with a vocabulary."""
from __future__ import annotations

import asyncio
import json
import random

import pytest

from tessera.bench import datasets
from tessera.bench.vocab import WordVocabulary

pytestmark = pytest.mark.unit


def write_jsonl(tmp_path, rows, name="d.jsonl"):
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_reads_prompts_and_optional_output_tokens_skipping_blank_lines(tmp_path):
    path = write_jsonl(tmp_path, [{"prompt": "a b", "output_tokens": 3}, "", {"prompt": "c", "extra": 1},
                                  {"prompt": "d", "output_tokens": 7.0}])
    rows = datasets.read_custom(path)
    assert [r["prompt"] for r in rows] == ["a b", "c", "d"]
    assert rows[0]["output_tokens"] == 3 and "output_tokens" not in rows[1] and rows[2]["output_tokens"] == 7
    assert [r["line"] for r in rows] == [1, 3, 4]


@pytest.mark.parametrize("line, named", [
    ("{not json", "d.jsonl:2: not JSON"),
    (json.dumps({"text": "no prompt"}), 'd.jsonl:2: expected an object with a "prompt" string'),
    (json.dumps(["a list"]), "d.jsonl:2: expected an object"),
    (json.dumps({"prompt": 5}), 'd.jsonl:2: expected an object with a "prompt" string'),
    (json.dumps({"prompt": "p", "output_tokens": 0}), '"output_tokens" must be a positive integer, got 0'),
    (json.dumps({"prompt": "p", "output_tokens": "ten"}), "got 'ten'"),
    (json.dumps({"prompt": "p", "output_tokens": 2.5}), "got 2.5"),
])
def test_a_bad_line_is_named(tmp_path, line, named):
    path = write_jsonl(tmp_path, [{"prompt": "fine"}, line])
    with pytest.raises(ValueError, match=None) as err:
        datasets.read_custom(path)
    assert named in str(err.value)


def test_not_jsonl_or_empty_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"\.jsonl file"):
        datasets.read_custom(str(tmp_path / "d.json"))
    with pytest.raises(ValueError, match="no prompts"):
        datasets.read_custom(write_jsonl(tmp_path, [""]))


ROWS = [{"prompt": f"q{i}", "output_tokens": 10 + i, "line": i + 1} for i in range(6)]


def test_choice_is_vllms_shuffle_then_first_n():
    expected = list(ROWS)
    random.seed(7)
    random.shuffle(expected)  # what vLLM's CustomDataset.load_data does with --seed 7
    chosen = datasets.sample_custom(ROWS, 4, seed=7, output_len=-1)
    assert chosen == [(r["prompt"], r["output_tokens"]) for r in expected[:4]]
    assert datasets.sample_custom(ROWS, 3, seed=7, output_len=5, shuffle=False) == [("q0", 5), ("q1", 5), ("q2", 5)]


def test_output_len_overrides_unless_none_or_minus_one():
    assert datasets.sample_custom(ROWS, 2, 0, None, shuffle=False) == [("q0", 10), ("q1", 11)]
    assert datasets.sample_custom(ROWS, 2, 0, 64, shuffle=False) == [("q0", 64), ("q1", 64)]
    with pytest.raises(ValueError, match=r'line 2: no "output_tokens" and no --custom-output-len'):
        datasets.sample_custom([ROWS[0], {"prompt": "x", "line": 2}], 2, 0, -1, shuffle=False)


def test_fewer_rows_than_asked_are_oversampled_as_vllm_unless_not():
    base = datasets.sample_custom(ROWS[:2], 2, 3, 8, shuffle=False)
    random.seed(3)
    extra = [random.choice(base) for _ in range(3)]  # vLLM's maybe_oversample_requests
    assert datasets.sample_custom(ROWS[:2], 5, 3, 8, shuffle=False) == base + extra
    assert datasets.sample_custom(ROWS[:2], 5, 3, 8, shuffle=False, oversample=False) == base


def test_custom_requests_count_prompt_lengths_with_the_vocabulary(tmp_path):
    path = write_jsonl(tmp_path, [{"prompt": "one two three"}, {"prompt": "four five", "output_tokens": 2}])
    samples = asyncio.run(datasets.custom_requests(WordVocabulary(), path, 2, 0, 9, shuffle=False))
    assert [(s.prompt, s.prompt_len, s.expected_output_len, s.system) for s in samples] == [
        ("one two three", 3, 9, None), ("four five", 2, 9, None)]
    assert samples[0].text() == "one two three"  # sent as it is: no template added client-side

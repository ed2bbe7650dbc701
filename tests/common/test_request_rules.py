"""tessera.common.request_rules: one rule, one message, whichever side checks it. The wire
message (absent fields unchecked), the engine's SamplingParams dataclass and a mapping of
present values give the same answer; the frontend's validation and the engine's
SamplingParams.validate are calls into it."""
from __future__ import annotations

import math

import pytest

from tessera.common.request_rules import (CHAT_ROLES, SAMPLING_RANGES, Problem, SamplingCaps, request_problem,
                                          sampling_problem, token_ids_problem)
from tessera.v1 import common_pb2
from tessera_engine.sampling_params import SamplingParams
from tessera_frontend.validation import Limits, ValidationError, validate_sampling_params

pytestmark = pytest.mark.unit

BAD = [  # (the fields set, the field named, the message after it)
    (dict(temperature=-0.5), "temperature", "must be >= 0 (got -0.5)"),
    (dict(temperature=math.nan), "temperature", "must be >= 0 (got nan)"),
    (dict(top_p=1.5), "top_p", "must be in (0, 1] (got 1.5)"),
    (dict(top_p=0.0), "top_p", "must be in (0, 1] (got 0.0)"),
    (dict(top_k=-2), "top_k", "must be >= -1 (-1 or 0 disables) (got -2)"),
    (dict(min_p=1.5), "min_p", "must be in [0, 1] (got 1.5)"),
    (dict(repetition_penalty=0.0), "repetition_penalty", "must be > 0 (got 0.0)"),
    (dict(presence_penalty=math.inf), "presence_penalty", "must be in [-2, 2] (got inf)"),
    (dict(frequency_penalty=-3.0), "frequency_penalty", "must be in [-2, 2] (got -3.0)"),
    (dict(max_tokens=0), "max_tokens", "must be >= 1 (got 0)"),
    (dict(max_tokens=4, min_tokens=5), "min_tokens", "must be in [0, max_tokens (4)] (got 5)"),
    (dict(n=0), "n", "must be >= 1 (got 0)"),
    (dict(logprobs=-1), "logprobs", "must be >= 0 (got -1)"),
    (dict(prompt_logprobs=-1), "prompt_logprobs", "must be >= 0 (got -1)"),
    (dict(stop_token_ids=[3, -1]), "stop_token_ids", "token ids must be >= 0"),
    (dict(logit_bias={5: 101.0}), "logit_bias", "the bias of token 5 must be in [-100, 100] (got 101.0)"),
    (dict(logit_bias={-5: 1.0}), "logit_bias", "token ids must be >= 0 (got -5)"),
]


@pytest.mark.parametrize("fields,field,detail", BAD, ids=[f"{f}-{i}" for i, (_, f, _) in enumerate(BAD)])
def test_the_wire_message_the_engines_dataclass_and_a_mapping_get_one_answer(fields, field, detail):
    expected = Problem(field, detail)
    assert sampling_problem(common_pb2.SamplingParams(**fields)) == expected
    assert sampling_problem(SamplingParams(**fields)) == expected
    assert sampling_problem(fields) == expected
    # the engine's validate and the frontend's validation are this rule, in their own exception
    with pytest.raises(ValueError) as engine:
        SamplingParams(**fields).validate()
    assert str(engine.value) == f"{field}: {detail}"
    with pytest.raises(ValidationError) as frontend:  # (with the frontend's caps)
        validate_sampling_params(common_pb2.SamplingParams(**fields), Limits())
    capped = sampling_problem(common_pb2.SamplingParams(**fields), Limits())
    assert (frontend.value.field, frontend.value.message) == (capped.field, capped.detail)
    assert capped.field == field


def test_absent_fields_are_not_checked_and_defaults_pass():
    assert sampling_problem(common_pb2.SamplingParams()) is None
    assert sampling_problem(SamplingParams()) is None
    assert sampling_problem({}) is None
    # min_tokens with no max_tokens on the wire: only its lower bound applies
    assert sampling_problem(common_pb2.SamplingParams(min_tokens=100)) is None


def test_one_row_per_numeric_field():
    fields = [rule.field for rule in SAMPLING_RANGES]
    assert len(fields) == len(set(fields))
    numeric = {"temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
               "frequency_penalty", "max_tokens", "min_tokens", "n", "logprobs", "prompt_logprobs"}
    assert set(fields) == numeric


def test_caps_bound_the_ranges_and_the_lists():
    caps = SamplingCaps(max_n=4, max_logprobs=5, max_stop=2, max_stop_chars=3, max_stop_token_ids=2,
                        max_logit_bias=1)
    cases = [
        (dict(n=5), Problem("n", "must be in [1, 4] (got 5)")),
        (dict(logprobs=6), Problem("logprobs", "must be in [0, 5] (got 6)")),
        (dict(stop=["a", "b", "c"]), Problem("stop", "at most 2 stop strings (got 3)")),
        (dict(stop=[""]), Problem("stop", "stop strings must not be empty")),
        (dict(stop=["abcd"]), Problem("stop", "a stop string has at most 3 characters")),
        (dict(stop_token_ids=[1, 2, 3]), Problem("stop_token_ids", "at most 2 ids (got 3)")),
        (dict(logit_bias={1: 1.0, 2: 1.0}), Problem("logit_bias", "at most 1 tokens (got 2)")),
    ]
    for fields, expected in cases:
        assert sampling_problem(common_pb2.SamplingParams(**fields), caps) == expected, fields
        assert sampling_problem(common_pb2.SamplingParams(**fields)) in (None, expected)  # no caps
    assert sampling_problem(common_pb2.SamplingParams(n=4, logprobs=5), caps) is None


def model_problem(prompt=(1, 2, 3), **kwargs) -> Problem | None:
    params = kwargs.pop("params", {})
    kwargs.setdefault("vocab_size", 10)
    return request_problem(SamplingParams(**params), list(prompt), **kwargs)


def test_the_model_and_engine_checks_name_the_field_and_their_status():
    assert model_problem(params=dict(max_tokens=4), max_model_len=8, kv_cache_tokens=8, max_num_seqs=2) is None
    assert model_problem(params=dict(top_k=11)) == Problem(
        "top_k", "must be at most the vocabulary size (10) (got 11)")
    assert model_problem(params=dict(n=3), max_num_seqs=2) == Problem("n", "must be at most max_num_seqs (2) (got 3)")
    assert model_problem(params=dict(stop_token_ids=[10])) == Problem(
        "stop_token_ids", "10 is outside the vocabulary [0, 10)")
    assert model_problem(eos_token_ids=[12]) == Problem("eos_token_ids", "12 is outside the vocabulary [0, 10)")
    assert model_problem(params=dict(logit_bias={10: 1.0})).field == "logit_bias"
    assert model_problem(prompt=[]) == Problem("prompt_token_ids", "must not be empty (the prompt has no tokens)")
    assert model_problem(prompt=[], prompt_field="prompt").field == "prompt"
    assert model_problem(prompt=[1, 10]) == Problem("prompt_token_ids", "10 is outside the vocabulary [0, 10)")
    assert model_problem(prompt=[1, 10], check_prompt_ids=False) is None
    too_long = model_problem(params=dict(max_tokens=6), max_model_len=8)
    assert too_long.field == "max_tokens" and too_long.code == "INVALID_ARGUMENT"
    assert "exceeds the model's max length (max_model_len 8)" in too_long.detail
    full = model_problem(params=dict(max_tokens=6), kv_cache_tokens=8)
    assert full.code == "RESOURCE_EXHAUSTED" and full.field == "max_tokens" and "KV cache" in full.detail
    assert model_problem(params=dict(max_tokens=6), kv_cache_tokens=8, kv_full_code="INVALID_ARGUMENT").code == \
        "INVALID_ARGUMENT"
    # a sliding window needs less of the cache than prompt + max_tokens
    assert model_problem(params=dict(max_tokens=6), kv_cache_tokens=8, kv_tokens_needed=8) is None
    # the sampling ranges come first, with the caps given
    assert model_problem(params=dict(logprobs=3), caps=SamplingCaps(max_logprobs=2)).field == "logprobs"
    # a wire message without defaults: no max_tokens, no length check
    assert request_problem(common_pb2.SamplingParams(), [1], vocab_size=10, max_model_len=1) is None


def test_token_ids_with_an_unknown_vocabulary_only_refuse_negative_ids():
    assert token_ids_problem("token_ids", [5, 10 ** 6], 0) is None
    assert token_ids_problem("token_ids", [5, -1], 0) == Problem("token_ids", "-1 is outside the vocabulary [0, 0)")


def test_problems_read_field_first():
    assert str(Problem("top_p", "must be in (0, 1] (got 2)")) == "top_p: must be in (0, 1] (got 2)"
    assert CHAT_ROLES == ("system", "user", "assistant", "tool")


def test_resumed_samples_of_a_migrated_request_are_checked():
    from tessera.common.request_rules import resumed_problem

    params = common_pb2.SamplingParams(max_tokens=5, n=2)
    assert resumed_problem({0: [1, 2], 1: []}, params, vocab_size=100) is None
    assert "not one of the request's n = 2" in str(resumed_problem({2: [1]}, params, vocab_size=100))
    assert "it has finished" in str(resumed_problem({0: [1, 2, 3, 4, 5]}, params, vocab_size=100))
    assert "outside the vocabulary" in str(resumed_problem({1: [7, 100]}, params, vocab_size=100))

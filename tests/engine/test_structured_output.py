"""Structured output in the engine core, on the default model: every output of a
constrained request is text its constraint accepts (JSON schema, regex, choice, grammar),
greedy and sampled, beside free requests whose tokens do not change; a constraint that
does not compile fails its request alone; logit_bias moves the tokens it names."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tessera.common.constraints import ConstraintError, StructuredOutputSpec, check_constraint
from tessera_engine.request import EngineCoreRequest
from tessera_engine.sampling_params import SamplingParams

from helpers.engine_fixtures import QUESTIONS, hf_tokenizer, loaded_fp32, make_core, model_source  # noqa: F401

pytestmark = [pytest.mark.unit, pytest.mark.slow]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "role": {"type": "string", "enum": ["student", "teacher", "engineer"]},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                      "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "role", "address", "skills"],
    "additionalProperties": False,
}
ARITHMETIC = r'''
root   ::= expr
expr   ::= term (("+" | "-") term)*
term   ::= factor (("*" | "/") factor)*
factor ::= [0-9]{1,3} | "(" expr ")"
'''


def chat(tok, text: str) -> list[int]:
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                   return_dict=False)


def run(core, reqs: list[EngineCoreRequest]) -> dict[str, list[int]]:
    out = core.generate(reqs)
    return {key.request_id: toks for key, toks in out.items()}


def constrained(spec: StructuredOutputSpec, max_tokens: int = 120, **kw) -> SamplingParams:
    return SamplingParams(temperature=kw.pop("temperature", 0.0), max_tokens=max_tokens, structured=spec, **kw)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_json_schema_outputs_parse_and_validate(make_core, hf_tokenizer, temperature):
    """Ten prompts, nested object, array, enum, pattern and required fields: every output is
    one JSON document valid against the schema, ended by the constraint (finish stop)."""
    core = make_core()
    spec = StructuredOutputSpec("json_schema", json.dumps(PERSON))
    reqs = [EngineCoreRequest(f"r{i}", chat(hf_tokenizer, f"Describe a person. {q}"),
                              constrained(spec, 200, temperature=temperature, seed=i))
            for i, q in enumerate(QUESTIONS[:10])]
    outs = run(core, reqs)
    for i in range(10):
        text = hf_tokenizer.decode(outs[f"r{i}"], skip_special_tokens=True)
        jsonschema.validate(json.loads(text), PERSON)
        assert len(outs[f"r{i}"]) < 200  # stopped by the constraint, not by max_tokens
    assert core.stats().num_blocks_free == core.stats().num_blocks_total


def test_regex_choice_and_grammar(make_core, hf_tokenizer):
    core = make_core()
    date = StructuredOutputSpec("regex", r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])")
    choice = StructuredOutputSpec("choice", ("positive", "negative", "neutral"))
    grammar = StructuredOutputSpec("grammar", ARITHMETIC)
    reqs = [EngineCoreRequest("date", chat(hf_tokenizer, "When did the first moon landing happen?"), constrained(date)),
            EngineCoreRequest("choice", chat(hf_tokenizer, "I love this film! Sentiment?"), constrained(choice)),
            EngineCoreRequest("expr", chat(hf_tokenizer, "Write an arithmetic expression equal to 12."),
                              constrained(grammar, 40))]
    tokens = run(core, reqs)
    outs = {k: hf_tokenizer.decode(v, skip_special_tokens=True) for k, v in tokens.items()}
    assert re.fullmatch(r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])", outs["date"]), outs["date"]
    assert outs["choice"] in choice.value
    expr = outs["expr"]
    assert re.fullmatch(r"[0-9+\-*/()]+", expr) and expr.count("(") == expr.count(")"), expr
    if len(tokens["expr"]) < 40:  # complete (not cut by max_tokens): a well-formed expression
        try:
            eval(compile(expr, "<expr>", "eval"), {"__builtins__": {}})
        except ArithmeticError:
            pass  # 1/0 is well-formed


def test_free_requests_are_unchanged_beside_constrained_ones(make_core, hf_tokenizer):
    """The same greedy tokens for free requests alone and batched with constrained ones:
    the mask touches only its own rows."""
    core = make_core()
    free = [EngineCoreRequest(f"f{i}", chat(hf_tokenizer, q), SamplingParams(temperature=0.0, max_tokens=32))
            for i, q in enumerate(QUESTIONS[:4])]
    alone = run(core, free)
    spec = StructuredOutputSpec("json_schema", json.dumps(PERSON))
    mixed = [EngineCoreRequest(r.request_id, r.prompt_token_ids, r.sampling_params) for r in free]
    mixed += [EngineCoreRequest(f"c{i}", chat(hf_tokenizer, q), constrained(spec))
              for i, q in enumerate(QUESTIONS[4:8])]
    together = run(core, mixed)
    assert {k: together[k] for k in alone} == alone
    for i in range(4):
        jsonschema.validate(json.loads(hf_tokenizer.decode(together[f"c{i}"], skip_special_tokens=True)), PERSON)


def test_constraint_survives_preemption(make_core, hf_tokenizer):
    """A pool too small for the batch preempts constrained requests; their matchers are
    dropped and rebuilt from the output so far, and every output still validates."""
    core = make_core(num_kv_blocks=24, block_size=16)
    spec = StructuredOutputSpec("json_schema", json.dumps(PERSON))
    reqs = [EngineCoreRequest(f"r{i}", chat(hf_tokenizer, q), constrained(spec, 150))
            for i, q in enumerate(QUESTIONS[:6])]
    outs = run(core, reqs)
    assert core.scheduler.num_preemptions > 0
    for i in range(6):
        jsonschema.validate(json.loads(hf_tokenizer.decode(outs[f"r{i}"], skip_special_tokens=True)), PERSON)


@pytest.mark.parametrize("spec,why", [
    (StructuredOutputSpec("json_schema", '{"type": "object", "properties": {"a": {"type": "nope"}}}'), "nope"),
    (StructuredOutputSpec("json_schema", "{not json"), "not valid JSON"),
    (StructuredOutputSpec("regex", "[0-9"), "regex"),
    (StructuredOutputSpec("grammar", "root ::= missing_rule"), "missing_rule"),
    (StructuredOutputSpec("choice", ()), "non-empty"),
])
def test_a_constraint_that_does_not_compile_fails_its_request_alone(make_core, hf_tokenizer, spec, why):
    with pytest.raises(ConstraintError, match=why):
        check_constraint(spec)
    core = make_core()
    good = EngineCoreRequest("ok", chat(hf_tokenizer, "hi"), SamplingParams(temperature=0.0, max_tokens=8))
    core.add_request(EngineCoreRequest("bad", chat(hf_tokenizer, "hi"), constrained(spec)))
    core.add_request(good)
    outs = []
    while core.has_unfinished():
        outs += core.step()
    bad = [o for o in outs if o.request_id == "bad"]
    assert len(bad) == 1 and bad[0].finish_reason == "error" and bad[0].error.code == "INVALID_ARGUMENT"
    assert why.split()[0] in bad[0].error.message or spec.kind in bad[0].error.message
    assert sum(len(o.new_token_ids) for o in outs if o.request_id == "ok") == 8
    assert core.stats().num_blocks_free == core.stats().num_blocks_total


def test_logit_bias_forces_and_bans_tokens(make_core, hf_tokenizer):
    core = make_core()
    prompt = chat(hf_tokenizer, "Name a planet.")
    free = run(core, [EngineCoreRequest("free", prompt, SamplingParams(temperature=0.0, max_tokens=6))])["free"]
    forced_id = hf_tokenizer.convert_tokens_to_ids("Ġbanana") if "Ġbanana" in hf_tokenizer.get_vocab() else 1000
    outs = run(core, [
        EngineCoreRequest("ban", prompt, SamplingParams(temperature=0.0, max_tokens=6, logit_bias={free[0]: -100.0})),
        EngineCoreRequest("force", prompt, SamplingParams(temperature=0.0, max_tokens=6,
                                                          logit_bias={forced_id: 100.0})),
    ])
    assert outs["ban"][0] != free[0]
    assert outs["force"] == [forced_id] * 6

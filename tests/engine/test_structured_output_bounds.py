"""The bounds a JSON constraint puts on numbers and strings whose schema states none
(tessera.common.constraints.bounded_schema, issue 37 item 8), held by the engine's own
matchers (StructuredOutputManager) over the default model's vocabulary: a 40-digit integer,
a 9th fraction digit, an exponent or a 2049-character string is refused where it passes the
bound, while the schema's own limits (maximum / minimum, multipleOf, maxLength, pattern) win."""
from __future__ import annotations

import json

import jsonschema
import pytest

from tessera.common.constraints import (KEY_MAX_LENGTH, NUMBER_MAX_ABS, STRING_MAX_LENGTH, StructuredOutputSpec,
                                        bounded_schema, check_constraint)
from tessera_engine.structured_output import StructuredOutputManager

from helpers.engine_fixtures import hf_tokenizer, model_source  # noqa: F401  (fixtures)

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def manager(hf_tokenizer):
    m = StructuredOutputManager(lambda: hf_tokenizer, len(hf_tokenizer))
    yield m
    m.shutdown()


def fed(manager, spec: StructuredOutputSpec, text: str) -> tuple[bool, bool]:
    """(every token of `text` allowed, the constraint then complete) for a fresh matcher."""
    matcher = manager.compile(spec).result(timeout=60).deep_copy()
    tok = manager._tokenizer.result()
    allowed = matcher.consume_tokens(tok.tokenize_str(text)) and not matcher.is_error()
    return allowed, allowed and matcher.is_accepting()


def schema_spec(schema) -> StructuredOutputSpec:
    return StructuredOutputSpec("json_schema", json.dumps(schema))


def value_of(schema, text: str, manager) -> tuple[bool, bool]:
    """`text` as the value of property "v" of an object whose "v" has `schema`."""
    obj = {"type": "object", "properties": {"v": schema}, "required": ["v"], "additionalProperties": False}
    return fed(manager, schema_spec(obj), '{"v": ' + text + "}")


def test_a_40_digit_integer_is_cut_off_at_16_digits(manager):
    assert value_of({"type": "integer"}, str(NUMBER_MAX_ABS), manager) == (True, True)
    assert value_of({"type": "integer"}, "-" + str(NUMBER_MAX_ABS), manager) == (True, True)
    assert value_of({"type": "integer"}, "1" * 17, manager)[0] is False
    assert value_of({"type": "integer"}, "1212222222212323232323" + "23" * 9, manager)[0] is False


def test_a_number_has_at_most_16_integer_and_8_fraction_digits_and_no_exponent(manager):
    number = {"type": "number"}
    for ok in ("0", "-0.5", "12.5", "3.14159265", "1234567890123456", "1234567890123456.12345678"):
        assert value_of(number, ok, manager) == (True, True), ok
    for bad in ("3.141592653", "1" * 17, "1e5", "2.5E-3", "1.2" + "2" * 40):
        assert value_of(number, bad, manager)[0] is False, bad


def test_a_string_without_a_max_length_is_cut_off(manager):
    string = {"type": "string"}
    assert value_of(string, json.dumps("a" * STRING_MAX_LENGTH), manager) == (True, True)
    assert value_of(string, json.dumps("a" * (STRING_MAX_LENGTH + 1)), manager)[0] is False


def test_the_schemas_own_limits_win(manager):
    # a maximum past ours: its digits are allowed; the minimum it lacks is ours
    assert value_of({"type": "integer", "maximum": 10 ** 18}, "9" * 18, manager) == (True, True)
    assert value_of({"type": "integer", "maximum": 10 ** 18}, "-" + "1" * 17, manager)[0] is False
    # minimum 0: no negative numbers, and our maximum above it
    assert value_of({"type": "number", "minimum": 0}, "-1", manager)[0] is False
    assert value_of({"type": "number", "minimum": 0}, "1" * 17, manager)[0] is False
    # its own multipleOf, not ours
    assert value_of({"type": "number", "multipleOf": 0.5}, "2.5", manager) == (True, True)
    assert value_of({"type": "number", "multipleOf": 0.5}, "2.25", manager)[0] is False
    assert value_of({"type": "number", "multipleOf": 1e-10}, "0.0000000001", manager) == (True, True)
    # its own maxLength (longer than ours), or a pattern: our string bound is not added
    long = "a" * (STRING_MAX_LENGTH + 500)
    assert value_of({"type": "string", "maxLength": STRING_MAX_LENGTH + 500}, json.dumps(long), manager) == (True, True)
    assert value_of({"type": "string", "pattern": "^a+$"}, json.dumps(long), manager) == (True, True)


def test_nested_and_nullable_values_are_bounded(manager):
    schema = {"type": "object", "$defs": {"n": {"type": ["number", "null"]}},
              "properties": {"a": {"type": "array", "items": {"$ref": "#/$defs/n"}},
                             "b": {"anyOf": [{"type": "integer"}, {"type": "boolean"}]}},
              "required": ["a", "b"], "additionalProperties": False}
    assert fed(manager, schema_spec(schema), '{"a": [1.5, null, -2], "b": 7}') == (True, True)
    assert fed(manager, schema_spec(schema), '{"a": [' + "1" * 40)[0] is False
    assert fed(manager, schema_spec(schema), '{"a": [], "b": ' + "1" * 40)[0] is False


def test_json_object_values_and_keys_are_bounded(manager):
    spec = StructuredOutputSpec("json_object")
    assert fed(manager, spec, '{"a": [1, 2.5, {"b": "x", "c": null}], "d": true, "e": {}}') == (True, True)
    assert fed(manager, spec, '{"a": ' + "1" * 40)[0] is False
    assert fed(manager, spec, '{"a": [{"b": 0.' + "3" * 40)[0] is False
    assert fed(manager, spec, '{"a": "' + "x" * (STRING_MAX_LENGTH + 1))[0] is False
    assert fed(manager, spec, '{"' + "k" * (KEY_MAX_LENGTH + 1))[0] is False
    assert fed(manager, spec, "[1]")[0] is False  # still an object


def test_bounded_schema_is_a_restriction_that_leaves_the_rest_alone():
    schema = {"type": "object",
              "properties": {"type": {"type": "string"}, "properties": {"type": "integer", "minimum": 3},
                             "tag": {"type": "string", "enum": ["a", "b"]}, "when": {"type": "string", "format": "date"},
                             "n": {"type": "number", "exclusiveMaximum": 0}},
              "required": ["type"]}
    out = bounded_schema(schema)
    props = out["properties"]
    assert props["type"] == {"type": "string", "maxLength": STRING_MAX_LENGTH}
    assert props["properties"] == {"type": "integer", "minimum": 3, "maximum": 3 + NUMBER_MAX_ABS}
    assert props["tag"] == schema["properties"]["tag"] and props["when"] == schema["properties"]["when"]
    assert props["n"] == {"type": "number", "exclusiveMaximum": 0, "minimum": -NUMBER_MAX_ABS, "multipleOf": 1e-8}
    assert out["required"] == ["type"] and schema["properties"]["type"] == {"type": "string"}  # a copy
    assert bounded_schema(True) is True and bounded_schema({}) == {}
    assert bounded_schema({"type": "string", "minLength": 5000}) == {"type": "string", "minLength": 5000,
                                                                      "maxLength": 5000}
    assert bounded_schema({"type": {"not": "a type"}}) == {"type": {"not": "a type"}}  # llguidance names the error
    # what the bounded schema accepts, the original accepts
    jsonschema.validate({"type": "x", "properties": 4, "n": -1.5}, schema)
    check_constraint(schema_spec(schema))

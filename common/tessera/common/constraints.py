"""Output constraints (structured output) as the services share them: what one is, the
llguidance grammar it becomes, and whether it compiles.

The frontend checks a request's constraint with these before it queues the request (an
invalid schema, regex or grammar is a 400 / INVALID_ARGUMENT at once); the engine compiles
it against the model's own tokenizer and applies it (tessera_engine.structured_output).
"""
from __future__ import annotations

import dataclasses
import json

KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")
# JSON may be laid out freely, but one run of whitespace between two tokens of the JSON is
# at most this long: a small model otherwise can loop on blank lines until max_tokens
JSON_OPTIONS = {"whitespace_pattern": r"[ \t\n\r]{0,24}"}
# The same for values a small model can write forever ("population_millions": 1212222222…,
# greedy, until max_tokens, so the client gets no JSON): where the schema states no limit of
# its own, bounded_schema bounds them in the grammar. A number: |x| <= 2**53 - 1 (at most 16
# integer digits, the integers a double holds exactly), at most 8 fraction digits and no
# exponent; a string: at most 2048 characters. The schema's own limits win: a number with a
# minimum / maximum (or exclusive ones) keeps it and gets ours on the other side only, one
# with a multipleOf keeps it; a string with a maxLength, pattern, format, enum or const is
# left as it is. json_object's values are bounded the same way, its keys at 256 characters.
NUMBER_MAX_ABS = 2 ** 53 - 1
NUMBER_MULTIPLE_OF = 1e-8
STRING_MAX_LENGTH = 2048
KEY_MAX_LENGTH = 256


class ConstraintError(ValueError):
    """A constraint that does not compile; the message says what is wrong with it."""


@dataclasses.dataclass(frozen=True)
class StructuredOutputSpec:
    kind: str                        # one of KINDS
    value: str | tuple[str, ...] = ""  # the schema / regex / grammar text, or the choices

    @classmethod
    def from_proto(cls, pb) -> "StructuredOutputSpec | None":
        which = pb.WhichOneof("constraint")
        if which is None:
            return None
        if which == "choice":
            return cls("choice", tuple(pb.choice.choices))
        if which == "json_object":
            return cls("json_object") if pb.json_object else None
        return cls(which, getattr(pb, which))

    def grammar(self) -> str:
        """The llguidance grammar of this constraint (ConstraintError where it cannot be one)."""
        import llguidance

        if self.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(bounded_json_object(), defaults=JSON_OPTIONS)
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.value)
            except ValueError as exc:
                raise ConstraintError(f"json_schema: not valid JSON ({exc})") from None
            if not isinstance(schema, (dict, bool)):
                raise ConstraintError("json_schema: must be a JSON object")
            # as text: llguidance takes no dict holding an integer past 64 bits (a maximum of 10**20)
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(bounded_schema(schema)),
                                                                 defaults=JSON_OPTIONS)
        if self.kind == "regex":
            if not self.value:
                raise ConstraintError("regex: must not be empty")
            return llguidance.LLMatcher.grammar_from_regex(self.value)
        if self.kind == "grammar":
            if not self.value.strip():
                raise ConstraintError("grammar: must not be empty")
            try:
                return llguidance.grammar_from("grammar", self.value)
            except ValueError as exc:
                raise ConstraintError(f"grammar: {exc}") from None
        if self.kind == "choice":
            if not self.value or any(not c for c in self.value):
                raise ConstraintError("choice: must be a non-empty list of non-empty strings")
            return llguidance.grammar_from("choice", list(self.value))
        raise ConstraintError(f"unknown constraint kind {self.kind!r}")


# the keywords whose value is a subschema or a list of them, and those with a map of names to them
_SUBSCHEMA = ("items", "additionalItems", "contains", "additionalProperties", "propertyNames", "not",
              "if", "then", "else", "unevaluatedItems", "unevaluatedProperties", "allOf", "anyOf", "oneOf",
              "prefixItems")
_SUBSCHEMA_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_NUMBER_LIMITS_LOW = ("minimum", "exclusiveMinimum")
_NUMBER_LIMITS_HIGH = ("maximum", "exclusiveMaximum")
_STRING_LIMITS = ("maxLength", "pattern", "format", "enum", "const")


def bounded_schema(schema):
    """A copy of a JSON schema whose numbers and strings have the bounds above where the
    schema states none (a restriction: what it accepts, the original accepts too)."""
    if isinstance(schema, list):
        return [bounded_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema  # true / false, or a keyword's non-schema value
    out = dict(schema)
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), (dict, list)):
            out[key] = bounded_schema(out[key])
    for key in _SUBSCHEMA_MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: bounded_schema(sub) for name, sub in out[key].items()}
    types = out.get("type")
    types = {t for t in (types if isinstance(types, list) else [types]) if isinstance(t, str)}
    if types & {"number", "integer"} and "enum" not in out and "const" not in out:
        low = next((out[k] for k in _NUMBER_LIMITS_LOW if _is_number(out.get(k))), None)
        high = next((out[k] for k in _NUMBER_LIMITS_HIGH if _is_number(out.get(k))), None)
        if low is None:  # below the schema's own maximum, however low that is
            out["minimum"] = min(-NUMBER_MAX_ABS, high - NUMBER_MAX_ABS) if high is not None else -NUMBER_MAX_ABS
        if high is None:
            out["maximum"] = max(NUMBER_MAX_ABS, low + NUMBER_MAX_ABS) if low is not None else NUMBER_MAX_ABS
        if "number" in types and "multipleOf" not in out:
            out["multipleOf"] = NUMBER_MULTIPLE_OF
    if "string" in types and not any(k in out for k in _STRING_LIMITS):
        min_length = out.get("minLength")  # never below the schema's own minLength
        out["maxLength"] = max(STRING_MAX_LENGTH, min_length if _is_number(min_length) else 0)
    return out


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def bounded_json_object() -> dict:
    """json_object's schema: any JSON object, its values bounded as bounded_schema bounds them."""
    key = f"^.{{0,{KEY_MAX_LENGTH}}}$"
    members = {"additionalProperties": False, "patternProperties": {key: {"$ref": "#/$defs/value"}}}
    value = {"anyOf": [{"type": "null"}, {"type": "boolean"}, bounded_schema({"type": "number"}),
                       bounded_schema({"type": "string"}), {"type": "array", "items": {"$ref": "#/$defs/value"}},
                       {"type": "object", **members}]}
    return {"$defs": {"value": value}, "type": "object", **members}


def check_constraint(spec: StructuredOutputSpec) -> None:
    """Raise ConstraintError naming the problem where `spec` does not compile (no vocabulary
    needed: for the frontend's checks, and the engine's before it queues the request)."""
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(spec.grammar())
    if error:
        raise ConstraintError(f"{spec.kind}: {error}")


def to_proto(spec: StructuredOutputSpec):
    """The tessera.v1.StructuredOutput of `spec`."""
    from tessera.v1 import common_pb2

    pb = common_pb2.StructuredOutput()
    if spec.kind == "choice":
        pb.choice.choices.extend(spec.value)
    elif spec.kind == "json_object":
        pb.json_object = True
    else:
        setattr(pb, spec.kind, spec.value)
    return pb

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
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.value)
            except ValueError as exc:
                raise ConstraintError(f"json_schema: not valid JSON ({exc})") from None
            if not isinstance(schema, (dict, bool)):
                raise ConstraintError("json_schema: must be a JSON object")
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
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

"""Structured output and logit_bias over the OpenAI HTTP API and the gRPC API, through the
real stack (each service its own process, the default model), with the real `openai`
client: response_format json_schema / json_object, vLLM's guided_* and structured_outputs
fields, streamed and not, the client's `beta.chat.completions.parse` with a pydantic
model, and a clear 400 / INVALID_ARGUMENT for a constraint that does not compile."""
from __future__ import annotations

import json
import re

import grpc
import jsonschema
import openai
import pydantic
import pytest

from helpers.stack import client, model, stack  # noqa: F401  (fixtures)
from tessera.v1 import common_pb2, frontend_pb2, tokenizer_pb2

pytestmark = pytest.mark.integration

CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "country": {"type": "string", "maxLength": 30},
        "population_millions": {"type": "number", "minimum": 0},
        "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 30}, "minItems": 1, "maxItems": 3},
        "climate": {"type": "string", "enum": ["cold", "temperate", "hot"]},
    },
    "required": ["city", "country", "landmarks", "climate"],
    "additionalProperties": False,
}
PROMPTS = ["Tell me about Paris.", "Tell me about Tokyo.", "Describe Cairo.", "Describe Oslo.",
           "What is Lima like?", "Tell me about Sydney.", "Describe Toronto.", "Tell me about Mumbai.",
           "What is Rome like?", "Describe Nairobi."]



def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_json_schema_every_output_validates(client, model, temperature, stream):
    """Ten prompts at once, greedy and sampled, streamed and whole: each reply parses and validates."""
    import concurrent.futures

    def ask(i: int, q: str) -> str:
        kw = dict(model=model, messages=user(q), max_tokens=160, temperature=temperature, seed=i,
                  response_format=json_schema_format(CITY))
        if not stream:
            r = client.chat.completions.create(**kw)
            assert r.choices[0].finish_reason == "stop"
            return r.choices[0].message.content
        chunks = [c for c in client.chat.completions.create(stream=True, **kw) if c.choices]
        assert chunks[-1].choices[0].finish_reason == "stop"
        return "".join(c.choices[0].delta.content or "" for c in chunks)

    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        replies = list(pool.map(ask, range(10), PROMPTS))
    for reply in replies:
        jsonschema.validate(json.loads(reply), CITY)


def test_json_schema_streamed_equals_unstreamed(client, model):
    kw = dict(model=model, messages=user(PROMPTS[0]), max_tokens=160, temperature=0.0,
              response_format=json_schema_format(CITY))
    whole = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **kw))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    jsonschema.validate(json.loads(streamed), CITY)


def test_json_object_and_vllm_fields(client, model):
    r = client.chat.completions.create(
        model=model, messages=user("Reply with a JSON object with the keys name and age for a cat called Tom."),
        max_tokens=200, temperature=0.0, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.chat.completions.create(model=model, messages=user("When was the first moon landing?"),
                                       max_tokens=20, temperature=0.0,
                                       extra_body={"guided_regex": r"[0-9]{4}-[0-9]{2}-[0-9]{2}"})
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", r.choices[0].message.content)
    r = client.chat.completions.create(model=model, messages=user("Is the sky blue? Answer."), max_tokens=10,
                                       temperature=0.0, extra_body={"guided_choice": ["yes", "no", "maybe"]})
    assert r.choices[0].message.content in ("yes", "no", "maybe")
    r = client.completions.create(model=model, prompt="The answer is", max_tokens=10, temperature=0.0,
                                  extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert r.choices[0].text in ("red", "green", "blue")
    r = client.chat.completions.create(model=model, messages=user("Describe Berlin."), max_tokens=160,
                                       temperature=0.0, extra_body={"guided_json": CITY})
    jsonschema.validate(json.loads(r.choices[0].message.content), CITY)


def test_openai_client_parse_with_a_pydantic_model(client, model):
    class Landmark(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=30)
        year_built: int

    class Answer(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=30)
        landmarks: list[Landmark] = pydantic.Field(min_length=1, max_length=2)

    parse = client.beta.chat.completions.parse if hasattr(client, "beta") else client.chat.completions.parse
    r = parse(model=model, messages=user("Tell me about Paris and its landmarks."), max_tokens=200,
              temperature=0.0, response_format=Answer)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Answer) and parsed.landmarks


def test_logit_bias_over_http(client, model):
    r = client.completions.create(model=model, prompt="The sky is", max_tokens=4, temperature=0.0,
                                  logit_bias={"28": 100})
    tokens = client.completions.create(model=model, prompt="The sky is", max_tokens=4, temperature=0.0)
    assert r.choices[0].text != tokens.choices[0].text
    assert r.usage.completion_tokens == 4


@pytest.mark.parametrize("extra,param,words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", "nope"),
    ({"extra_body": {"guided_regex": "[0-9"}}, "guided_regex", "regex"),
    ({"extra_body": {"guided_grammar": "root ::= undefined_rule"}}, "guided_grammar", "undefined_rule"),
    ({"extra_body": {"guided_json": "{bad json"}}, "guided_json", "not valid JSON"),
    ({"extra_body": {"guided_regex": "a", "guided_choice": ["a"]}}, "guided_choice", "only one"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
    ({"logit_bias": {"5": 150}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias", "outside the vocabulary"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
])
def test_bad_constraints_are_400_naming_the_param(client, model, extra, param, words):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=user("hi"), max_tokens=5, **extra)
    body = info.value.body
    assert info.value.status_code == 400 and body["param"] == param, body
    assert words in body["message"], body
    # the stack keeps serving
    assert client.chat.completions.create(model=model, messages=user("hi"), max_tokens=3).choices[0].message


def test_grpc_structured_output_and_invalid_argument(stack):
    chat = tokenizer_pb2.ChatMessages(messages=[tokenizer_pb2.ChatMessage(role="user", content="Tell me about Oslo.")])
    params = common_pb2.SamplingParams(temperature=0.0, max_tokens=160, structured_output=common_pb2.StructuredOutput(
        json_schema=json.dumps(CITY)))
    result = stack.frontend_stub.Complete(frontend_pb2.GenerateRequest(chat=chat, sampling_params=params), timeout=180)
    jsonschema.validate(json.loads(result.choices[0].text), CITY)
    bad = common_pb2.SamplingParams(max_tokens=5, structured_output=common_pb2.StructuredOutput(regex="(unclosed"))
    with pytest.raises(grpc.RpcError) as info:
        stack.frontend_stub.Complete(frontend_pb2.GenerateRequest(chat=chat, sampling_params=bad), timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "structured_output" in info.value.details() and "regex" in info.value.details()


def test_best_of_answers_the_most_likely_samples(client, model):
    """best_of=3, n=1, seeded: the answer is, of the same three samples asked for with n=3,
    the one whose tokens have the highest summed logprob; usage counts all three."""
    kw = dict(model=model, prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=11)
    three = client.completions.create(n=3, logprobs=0, **kw)
    scores = [sum(c.logprobs.token_logprobs) for c in three.choices]
    best = client.completions.create(n=1, extra_body={"best_of": 3}, **kw)
    assert len(best.choices) == 1 and best.choices[0].logprobs is None
    assert best.choices[0].text == three.choices[scores.index(max(scores))].text
    assert best.usage.completion_tokens == three.usage.completion_tokens
    two = client.completions.create(n=2, extra_body={"best_of": 3}, logprobs=0, **kw)
    ranked = sorted(range(3), key=lambda i: -scores[i])
    assert [c.text for c in two.choices] == [three.choices[i].text for i in ranked[:2]]
    for extra, words in (({"n": 2, "extra_body": {"best_of": 1}}, "must be >= n"),
                         ({"stream": True, "extra_body": {"best_of": 2}}, "stream")):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=model, prompt="hi", max_tokens=3, **extra)
        assert info.value.body["param"] == "best_of" and words in info.value.body["message"]


@pytest.mark.parametrize("number", [float, int])
def test_a_number_cannot_run_away(client, number):
    """Issue 37 item 8: "Describe Paris as JSON." with name, country and a number, greedy and
    120 tokens, wrote population_millions' digits until max_tokens (LengthFinishReasonError);
    the grammar's bound on numbers (constraints.bounded_schema) ends the JSON in time."""
    class City(pydantic.BaseModel):
        name: str
        country: str
        population_millions: number

    served = client.models.list().data[0].id
    parse = client.beta.chat.completions.parse if hasattr(client, "beta") else client.chat.completions.parse
    r = parse(model=served, messages=user("Describe Paris as JSON."), max_tokens=120, temperature=0.0,
              response_format=City)
    assert r.choices[0].finish_reason == "stop"
    city = r.choices[0].message.parsed
    assert isinstance(city, City) and city.name and city.country
    assert abs(city.population_millions) <= 2 ** 53 - 1

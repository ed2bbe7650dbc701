"""tessera.client against the real stack (the session `stack` fixture): streaming and whole
answers, the prompt kinds, n, logprobs, structured output, tools, deadlines, cancellation
(the engine aborts), and errors; both the asyncio and the blocking client (integration)."""
from __future__ import annotations

import asyncio
import json
import time

import pytest

from helpers.stack import stack, wait_engine_idle  # noqa: F401  (the session fixture)
from tessera.client import (AsyncClient, Client, Completion, DeadlineExceededError, Delta, InvalidArgumentError,
                            NotFoundError)
from tessera.v1 import engine_pb2, tokenizer_pb2

pytestmark = pytest.mark.integration

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
LONG = [{"role": "user", "content": "Write a very long story about a dragon."}]


@pytest.fixture(scope="module")
def client(stack):  # noqa: F811
    with Client(stack.frontend.addr, timeout=120) as c:
        yield c


def run(coroutine_fn, stack, **client_args):  # noqa: F811
    """Run `coroutine_fn(AsyncClient)` in a fresh event loop, the client closed after."""
    async def main():
        async with AsyncClient(stack.frontend.addr, **{"timeout": 120, **client_args}) as c:
            return await coroutine_fn(c)
    return asyncio.run(main())


def test_async_generate_streams_typed_deltas(stack):  # noqa: F811
    async def go(c):
        return [d async for d in c.generate(messages=QUESTION, max_tokens=16, temperature=0)]
    deltas = run(go, stack)
    assert all(isinstance(d, Delta) for d in deltas) and len(deltas) >= 2
    assert "Paris" in "".join(d.text for d in deltas)
    assert deltas[-1].finish_reason in ("stop", "length") and deltas[-1].usage.completion_tokens == \
        sum(len(d.token_ids) for d in deltas)
    assert len({d.request_id for d in deltas}) == 1


def test_complete_equals_the_stream(stack, client):  # noqa: F811
    async def go(c):
        streamed = "".join([d.text async for d in c.generate(messages=QUESTION, max_tokens=16, temperature=0)])
        return streamed, await c.complete(messages=QUESTION, max_tokens=16, temperature=0)
    streamed, whole = run(go, stack)
    assert isinstance(whole, Completion) and whole.text == streamed
    sync = client.complete(messages=QUESTION, max_tokens=16, temperature=0)
    assert sync.text == streamed and sync.usage.prompt_tokens > 0
    assert "".join(d.text for d in client.generate(messages=QUESTION, max_tokens=16, temperature=0)) == streamed


def test_text_and_token_id_prompts(stack, client):  # noqa: F811
    text = client.complete(prompt="The capital of France is", max_tokens=4, temperature=0)
    ids = list(stack.tokenizer_stub.Tokenize(tokenizer_pb2.TokenizeRequest(text="The capital of France is"),
                                             timeout=10).token_ids)
    by_ids = client.complete(prompt=ids, max_tokens=4, temperature=0)
    assert text.text == by_ids.text and text.choices[0].token_ids == by_ids.choices[0].token_ids
    assert by_ids.usage.prompt_tokens == len(ids)


def test_n_logprobs_and_sampling_fields(client):
    answer = client.complete(messages=[{"role": "user", "content": "Tell me a short joke."}], n=2, max_tokens=8,
                             temperature=0.9, seed=1234, top_p=0.95, top_k=40, logprobs=2, prompt_logprobs=1,
                             stop=["\n\n"], presence_penalty=0.1, frequency_penalty=0.1, repetition_penalty=1.05,
                             min_tokens=1, logit_bias={0: -100})
    assert [c.index for c in answer.choices] == [0, 1]
    for choice in answer.choices:
        assert len(choice.logprobs) == len(choice.token_ids) > 0
        for token_id, position in zip(choice.token_ids, choice.logprobs):
            assert position.chosen.token_id == token_id and position.chosen.logprob <= 0 and len(position.top) == 2
    assert answer.usage.completion_tokens == sum(len(c.token_ids) for c in answer.choices)
    assert len(answer.prompt_logprobs) == answer.usage.prompt_tokens and answer.prompt_logprobs[0] is None
    assert all(p.chosen.rank >= 1 and len(p.top) == 1 for p in answer.prompt_logprobs[1:])
    again = client.complete(messages=[{"role": "user", "content": "Tell me a short joke."}], n=2, max_tokens=8,
                            temperature=0.9, seed=1234, top_p=0.95, top_k=40, stop=["\n\n"], presence_penalty=0.1,
                            frequency_penalty=0.1, repetition_penalty=1.05, min_tokens=1, logit_bias={0: -100})
    assert [c.text for c in again.choices] == [c.text for c in answer.choices]


def test_json_schema_output(client):
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
              "required": ["city", "population"], "additionalProperties": False}
    answer = client.complete(messages=[{"role": "user", "content": "Give the largest city of France as JSON."}],
                             max_tokens=60, temperature=0,
                             response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
    value = json.loads(answer.text)
    assert set(value) == {"city", "population"} and isinstance(value["population"], int)
    choice = client.complete(prompt="Is the sky blue? Answer:", max_tokens=5,
                             response_format={"type": "choice", "choice": ["yes", "no"]})
    assert choice.text in ("yes", "no")


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def test_tools_give_parsed_calls(stack, client):  # noqa: F811
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    answer = client.complete(messages=messages, tools=TOOLS, tool_choice="required", max_tokens=60, temperature=0)
    calls = answer.choices[0].tool_calls
    assert calls and calls[0].name == "get_weather" and "city" in json.loads(calls[0].arguments)
    assert answer.choices[0].content is None

    async def go(c):
        return [d async for d in c.generate(messages=messages, tools=TOOLS, max_tokens=60, temperature=0,
                                            tool_choice={"type": "function", "function": {"name": "get_weather"}})]
    deltas = run(go, stack)
    assert [c.name for c in deltas[-1].tool_calls] == ["get_weather"]
    # auto: whatever the model answers, the text splits into content and calls without loss
    auto = client.complete(messages=messages, tools=TOOLS, max_tokens=40, temperature=0).choices[0]
    assert auto.tool_calls or auto.content == auto.text


def test_deadline_exceeded(stack, client):  # noqa: F811
    with pytest.raises(DeadlineExceededError):
        client.complete(messages=LONG, max_tokens=400, ignore_eos=True, timeout=0.5)

    async def go(c):
        async for _ in c.generate(messages=LONG, max_tokens=400, ignore_eos=True):
            pass
    with pytest.raises(DeadlineExceededError) as caught:
        run(go, stack, timeout=0.5)
    assert caught.value.code.name == "DEADLINE_EXCEEDED"
    wait_engine_idle(stack.engine_stub, seconds=10, require=True)


def test_leaving_the_loop_cancels_in_the_engine(stack):  # noqa: F811
    async def go(c):
        received = 0
        async for delta in c.generate(messages=LONG, max_tokens=400, ignore_eos=True, temperature=0):
            received += len(delta.token_ids)
            if received >= 3:
                running = stack.engine_stub.GetStats(engine_pb2.GetStatsRequest(), timeout=5)
                assert running.num_running + running.num_waiting >= 1
                break
        await asyncio.sleep(0)  # the loop is free to send the cancellation
        return await asyncio.to_thread(wait_engine_idle, stack.engine_stub, 3.0, True)
    run(go, stack)


def test_leaving_the_sync_loop_cancels_in_the_engine(stack, client):  # noqa: F811
    received = 0
    for delta in client.generate(messages=LONG, max_tokens=400, ignore_eos=True, temperature=0):
        received += len(delta.token_ids)
        if received >= 3:
            break
    wait_engine_idle(stack.engine_stub, require=True)
    with client.generate(messages=LONG, max_tokens=400, ignore_eos=True) as stream:
        next(stream)
    assert list(stream) == []  # closed: the stream ends
    wait_engine_idle(stack.engine_stub, require=True)


def test_errors_carry_the_servers_message(stack, client):  # noqa: F811
    with pytest.raises(InvalidArgumentError) as caught:
        client.complete(prompt="Hi", max_tokens=0)
    assert caught.value.message.startswith("sampling_params.max_tokens") or "max_tokens" in caught.value.message

    async def go(c):
        return [d async for d in c.generate(prompt="Hi", temperature=-1.0)]
    with pytest.raises(InvalidArgumentError, match="temperature"):
        run(go, stack)
    with pytest.raises(NotFoundError, match="nope"):
        client.complete(prompt="Hi", max_tokens=2, lora_name="nope")
    with pytest.raises(ValueError, match="exactly one of prompt"):
        client.complete(max_tokens=2)


def test_one_channel_serves_many_calls(stack):  # noqa: F811
    async def go(c):
        answers = await asyncio.gather(*(c.complete(prompt=f"{i} + {i} =", max_tokens=3, temperature=0) for i in range(6)))
        return answers, c._channel
    start = time.monotonic()
    answers, channel = run(go, stack)
    assert len(answers) == 6 and all(a.choices[0].token_ids for a in answers) and channel is not None
    assert time.monotonic() - start < 120


def test_models_tokens_and_server_info(stack, client):  # noqa: F811
    info = client.server_info()
    assert info.model and info.max_model_len > 0 and info.vocab_size > 0 and info.eos_token_ids
    models = client.list_models()
    assert models[0].id == info.model and models[0].parent == ""
    tokens = client.tokenize(text="The capital of France is", return_token_strs=True, return_offsets=True)
    assert tokens.token_ids and len(tokens.token_strs) == len(tokens.offsets) == len(tokens.token_ids)
    assert client.detokenize(tokens.token_ids) == tokens.text
    chat = client.tokenize(messages=QUESTION)
    assert client.complete(prompt=list(chat.token_ids), max_tokens=16, temperature=0).text == \
        client.complete(messages=QUESTION, max_tokens=16, temperature=0).text

    async def go(c):
        return await c.server_info(), await c.list_lora_adapters(), await c.detokenize([tokens.token_ids[0]])
    async_info, adapters, first = run(go, stack)
    assert async_info == info and adapters.adapters == () and first == client.detokenize(tokens.token_ids[:1])

"""End-to-end tests through the real tokenizer, engine and frontend processes (no mocks)."""
from __future__ import annotations

import os
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from helpers.stack import free_port, health_status, stack, wait_engine_idle  # noqa: F401  (the session fixture)
from tessera.v1 import common_pb2, engine_pb2, frontend_pb2, tokenizer_pb2

pytestmark = pytest.mark.integration

QUESTION = "What is the capital of France? Answer in one word."
STOP = common_pb2.FINISH_REASON_STOP
LENGTH = common_pb2.FINISH_REASON_LENGTH


def chat(text: str) -> tokenizer_pb2.ChatMessages:
    return tokenizer_pb2.ChatMessages(messages=[tokenizer_pb2.ChatMessage(role="user", content=text)])


def generate(stack, text: str = QUESTION, metadata=None, **params) -> list[frontend_pb2.GenerateResponse]:
    request = frontend_pb2.GenerateRequest(chat=chat(text),
                                           sampling_params=common_pb2.SamplingParams(**params))
    return list(stack.frontend_stub.Generate(request, timeout=120, metadata=metadata))


def joined(responses, index: int = 0) -> tuple[str, list[int]]:
    mine = [r for r in responses if r.index == index]
    return "".join(r.text for r in mine), [t for r in mine for t in r.token_ids]


def test_greedy_chat_answer(stack):
    responses = generate(stack, temperature=0.0, max_tokens=16)
    text, token_ids = joined(responses)
    assert "Paris" in text, stack.logs()

    # The streamed deltas add up to the detokenization of every token received.
    full = stack.tokenizer_stub.Detokenize(
        tokenizer_pb2.DetokenizeRequest(token_ids=token_ids, skip_special_tokens=True), timeout=10)
    assert text == full.text

    prompt = stack.tokenizer_stub.Tokenize(tokenizer_pb2.TokenizeRequest(chat=chat(QUESTION)), timeout=10)
    last = responses[-1]
    assert last.usage.completion_tokens == len(token_ids)
    assert last.usage.prompt_tokens == len(prompt.token_ids)
    assert last.finish_reason in (STOP, LENGTH)
    assert all(r.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED for r in responses[:-1])
    assert not any(r.HasField("usage") for r in responses[:-1])
    assert len({r.request_id for r in responses}) == 1 and responses[0].request_id


def test_complete_matches_generate(stack):
    streamed, ids = joined(generate(stack, temperature=0.0, max_tokens=16))
    result = stack.frontend_stub.Complete(frontend_pb2.GenerateRequest(
        request_id="complete-1", chat=chat(QUESTION),
        sampling_params=common_pb2.SamplingParams(temperature=0.0, max_tokens=16)), timeout=120)
    assert result.request_id == "complete-1"
    [choice] = result.choices
    assert choice.text == streamed and list(choice.token_ids) == ids
    assert result.usage.completion_tokens == len(ids)


def test_request_id_from_metadata(stack):
    responses = generate(stack, metadata=(("x-request-id", "meta-42"),), temperature=0.0, max_tokens=4)
    assert {r.request_id for r in responses} == {"meta-42"}


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_cuts_text(stack, include):
    question = "Why is the sky blue?"
    full_text, full_ids = joined(generate(stack, question, temperature=0.0, max_tokens=40))
    words = full_text.split()
    assert len(words) > 6, full_text
    stop = words[len(words) // 2]
    cut = full_text.index(stop)

    responses = generate(stack, question, temperature=0.0, max_tokens=40, stop=[stop],
                         include_stop_str_in_output=include)
    text, ids = joined(responses)
    last = responses[-1]
    assert text == full_text[:cut] + (stop if include else "")
    assert last.finish_reason == STOP
    assert last.stop_reason == stop
    assert last.usage.completion_tokens == len(ids) <= len(full_ids)
    assert ids == full_ids[:len(ids)]
    wait_engine_idle(stack.engine_stub, require=True)


def test_stop_string_waits_for_min_tokens(stack):
    """A stop string in the text of the first min_tokens tokens does not end the request (vLLM)."""
    question = "Why is the sky blue?"
    full_text, full_ids = joined(generate(stack, question, temperature=0.0, max_tokens=40, ignore_eos=True))
    stop = " the"
    assert stop in full_text, full_text
    first = full_text.index(stop)
    # the token count up to and including the first occurrence's end
    upto = next(k for k in range(1, len(full_ids) + 1)
                if stack.tokenizer_stub.Detokenize(tokenizer_pb2.DetokenizeRequest(token_ids=full_ids[:k]),
                                                   timeout=10).text.find(stop) != -1)
    text, ids = joined(generate(stack, question, temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop]))
    assert text == full_text[:first]

    responses = generate(stack, question, temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop],
                         min_tokens=upto)
    text, ids = joined(responses)
    later = full_text.find(stop, first + 1)
    assert text == (full_text[:later] if later != -1 else full_text)
    assert len(ids) > upto and ids == full_ids[:len(ids)]
    assert responses[-1].finish_reason == (STOP if later != -1 else LENGTH)


def test_cancel_mid_stream_aborts_in_engine(stack):
    request = frontend_pb2.GenerateRequest(
        chat=chat("Write a very long story about a dragon."),
        sampling_params=common_pb2.SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True))
    call = stack.frontend_stub.Generate(request, timeout=120)
    received = 0
    for response in call:
        received += len(response.token_ids)
        if received >= 3:
            break
    running = stack.engine_stub.GetStats(engine_pb2.GetStatsRequest(), timeout=5)
    assert running.num_running + running.num_waiting >= 1
    call.cancel()
    wait_engine_idle(stack.engine_stub, require=True)


def test_two_samples(stack):
    responses = generate(stack, "Tell me a short joke.", temperature=0.9, seed=1234, n=2, max_tokens=12)
    finals = [r for r in responses if r.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED]
    assert sorted(r.index for r in finals) == [0, 1]
    assert {r.index for r in responses} == {0, 1}
    counts = [len(joined(responses, i)[1]) for i in (0, 1)]
    assert all(c > 0 for c in counts)
    assert responses[-1].usage.completion_tokens == sum(counts)

    again = generate(stack, "Tell me a short joke.", temperature=0.9, seed=1234, n=2, max_tokens=12)
    assert [joined(again, i) for i in (0, 1)] == [joined(responses, i) for i in (0, 1)]


def test_a_choice_stopped_by_a_stop_string_is_aborted_alone(stack):
    """n=2: one choice ends on a stop string while the other runs on; the engine aborts
    just that sample (AbortRequests.samples) and the other finishes by length."""
    from helpers.metrics_util import scrape, wait_for

    question = "Tell me a short story about a dragon."
    params = dict(temperature=1.0, seed=77, n=2, max_tokens=40, ignore_eos=True)
    free = generate(stack, question, **params)
    texts = [joined(free, i)[0] for i in (0, 1)]
    # a word of choice 0's early text that choice 1 never writes
    candidates = [w for w in texts[0].split()[1:8] if len(w) > 3 and w not in texts[1]]
    if not candidates:
        pytest.skip(f"the two seeded choices share their early words: {texts!r}")
    stop = candidates[0]

    before = scrape(stack.engine.metrics_url)
    responses = generate(stack, question, stop=[stop], **params)
    finals = {r.index: r for r in responses if r.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED}
    assert finals[0].finish_reason == STOP and finals[0].stop_reason == stop
    assert finals[1].finish_reason == LENGTH
    assert joined(responses, 1) == joined(free, 1)
    assert joined(responses, 0)[0] == texts[0][:texts[0].index(stop)]
    # the engine counted one sample aborted (before, a stopped choice ran on to its length)
    reason = 'finished_reason="abort"'
    wait_for(lambda: (scrape(stack.engine.metrics_url) - before).get("tessera:request_success_total",
                                                                      finished_reason="abort") == 1,
             timeout=10, what=f"one engine sample counted as {reason}")
    delta = scrape(stack.engine.metrics_url) - before
    assert delta.get("tessera:request_success_total", finished_reason="length") == 1
    wait_engine_idle(stack.engine_stub, require=True)


def test_logprobs(stack):
    responses = generate(stack, temperature=0.0, max_tokens=5, logprobs=2)
    for r in responses:
        assert len(r.logprobs) == len(r.token_ids)
        for token_id, position in zip(r.token_ids, r.logprobs):
            assert position.chosen.token_id == token_id
            assert position.chosen.logprob <= 0.0
            assert len(position.top) == 2
    # The frontend fills in each token's text: for this plain-ASCII answer they spell the text.
    token_texts = "".join(p.chosen.token for r in responses for p in r.logprobs)
    assert token_texts.startswith(joined(responses)[0])
    assert all(t.token for r in responses for p in r.logprobs for t in p.top)


def test_cli_generate(stack):
    env = dict(os.environ, TESSERA_FRONTEND_ADDR=stack.frontend.addr)
    done = subprocess.run(
        [sys.executable, "-m", "tessera.cli", "generate", QUESTION, "--temperature", "0",
         "--max-tokens", "16", "--wait", "30"],
        capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout
    assert "completion_tokens=" in done.stderr

    health = subprocess.run([sys.executable, "-m", "tessera.cli", "health", "--addr", stack.frontend.addr],
                            capture_output=True, text=True, timeout=60)
    assert health.returncode == 0 and health.stdout.strip() == "SERVING"
    # the images' HEALTHCHECK: any service's HTTP /health on its metrics port
    for service in (stack.tokenizer, stack.engine, stack.frontend):
        health = subprocess.run([sys.executable, "-m", "tessera.cli", "health", "--metrics-addr",
                                 f"{service.host}:{service.metrics_port}"], capture_output=True, text=True, timeout=60)
        assert health.returncode == 0 and health.stdout.strip() == "SERVING", (service.name, health.stderr)
    nobody = subprocess.run([sys.executable, "-m", "tessera.cli", "health", "--metrics-addr", f"127.0.0.1:{free_port()}"],
                            capture_output=True, text=True, timeout=60)
    assert nobody.returncode == 1 and "failed" in nobody.stderr


def test_cli_reports_errors(stack):
    done = subprocess.run(
        [sys.executable, "-m", "tessera.cli", "generate", QUESTION, "--addr", stack.frontend.addr,
         "--max-tokens", "0"],
        capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "INVALID_ARGUMENT" in done.stderr and "max_tokens" in done.stderr


def test_frontend_health_and_reflection(stack):
    serving = health_pb2.HealthCheckResponse.SERVING
    assert health_status(stack.frontend_channel) == serving
    assert health_status(stack.frontend_channel, "tessera.v1.FrontendService") == serving

    reflection = reflection_pb2_grpc.ServerReflectionStub(stack.frontend_channel)
    replies = reflection.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
    names = {s.name for reply in replies for s in reply.list_services_response.service}
    assert {"tessera.v1.FrontendService", "grpc.health.v1.Health"} <= names


def test_concurrent_requests_do_not_mix(stack):
    """Several greedy requests in flight at once each get their own, complete answer."""
    request = frontend_pb2.GenerateRequest(
        chat=chat(QUESTION), sampling_params=common_pb2.SamplingParams(temperature=0.0, max_tokens=16))
    futures = [stack.frontend_stub.Complete.future(request, timeout=120) for _ in range(4)]
    results = [f.result() for f in futures]
    assert len({r.request_id for r in results}) == len(results)
    for result in results:
        assert "Paris" in result.choices[0].text
        assert result.usage.completion_tokens == len(result.choices[0].token_ids)


def test_prompts_tokenized_together_get_their_own_ids(stack):
    """Requests tokenized at once (items of one tokenize stream) each get their own prompt's
    ids; a prompt the tokenizer refuses fails alone, INVALID_ARGUMENT naming the field."""
    params = common_pb2.SamplingParams(temperature=0.0, max_tokens=2)
    prompts = ["Hi", "Water boils at", "The largest planet in the solar system is",
               "Count with me, slowly and clearly: one, two, three, four, five,"]
    too_long = frontend_pb2.GenerateRequest(text="x" * 1_000_001, sampling_params=params)  # tokenizer's default cap
    good = [frontend_pb2.GenerateRequest(text=p, sampling_params=params) for p in prompts]
    mixed = [good[0], too_long, good[1], good[2], too_long, good[3]]
    futures = [stack.frontend_stub.Complete.future(r, timeout=120) for r in mixed]
    for request, future in zip(mixed, futures):
        if request is too_long:
            with pytest.raises(grpc.RpcError) as err:
                future.result()
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "text: 1000001 characters" in err.value.details(), err.value.details()
            continue
        result = future.result()
        alone = stack.frontend_stub.Complete(request, timeout=120)
        ids = stack.tokenizer_stub.Tokenize(tokenizer_pb2.TokenizeRequest(text=request.text), timeout=10).token_ids
        assert result.usage.prompt_tokens == alone.usage.prompt_tokens == len(ids)
        assert result.choices[0].token_ids == alone.choices[0].token_ids


def test_prompt_as_text_and_as_token_ids(stack):
    prompt = "The capital of France is"
    params = common_pb2.SamplingParams(temperature=0.0, max_tokens=8)
    by_text = stack.frontend_stub.Complete(frontend_pb2.GenerateRequest(text=prompt, sampling_params=params),
                                           timeout=120)
    ids = stack.tokenizer_stub.Tokenize(tokenizer_pb2.TokenizeRequest(text=prompt), timeout=10).token_ids
    by_ids = stack.frontend_stub.Complete(frontend_pb2.GenerateRequest(
        token_ids=frontend_pb2.TokenIds(ids=ids), sampling_params=params), timeout=120)
    assert by_text.choices[0].token_ids == by_ids.choices[0].token_ids
    assert by_text.choices[0].text == by_ids.choices[0].text and by_text.choices[0].text
    assert by_text.usage.prompt_tokens == by_ids.usage.prompt_tokens == len(ids)


def test_every_sampling_field_and_priority(stack):
    """A request setting every SamplingParams field (and a priority) streams n choices with logprobs."""
    params = common_pb2.SamplingParams(
        temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, seed=11, repetition_penalty=1.1,
        presence_penalty=0.5, frequency_penalty=0.5, stop=["\n\n\n"], stop_token_ids=[0], max_tokens=10,
        min_tokens=2, ignore_eos=False, n=2, logprobs=1, prompt_logprobs=1, skip_special_tokens=True,
        include_stop_str_in_output=False)
    responses = list(stack.frontend_stub.Generate(frontend_pb2.GenerateRequest(
        request_id="every-field", chat=chat(QUESTION), sampling_params=params, priority=-3), timeout=120))
    assert {r.request_id for r in responses} == {"every-field"}
    finals = [r for r in responses if r.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED]
    assert sorted(r.index for r in finals) == [0, 1]
    for r in responses:
        assert len(r.logprobs) == len(r.token_ids)
        assert all(len(p.top) == 1 and p.chosen.token for p in r.logprobs)
    counts = [len(joined(responses, i)[1]) for i in (0, 1)]
    assert all(2 <= c <= 10 for c in counts)
    assert responses[-1].usage.completion_tokens == sum(counts)
    with_prompt = [r for r in responses if r.prompt_logprobs]
    assert len(with_prompt) == 1  # once, on the first message
    # one per prompt position (the first has no candidates), even when the prompt is cached
    assert len(with_prompt[0].prompt_logprobs) == responses[-1].usage.prompt_tokens

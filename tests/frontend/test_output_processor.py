"""The frontend's OutputProcessor in-process, with a fake detokenize stream (as vLLM's
tests/v1/engine/test_output_processor.py drives its processor with a fake detokenizer).

The fake stands in for the tokenizer *client* object: its detokenize stream turns each
token id into a fixed word, matches stop strings the way the tokenizer reports them
(stop_matched, tokens_consumed, finished) and records what the processor sent and
cancelled. The tests check the SampleOutputs on each request's queue and the aborts each
processor call returns to its caller (it never calls into the engine itself).
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import math

import grpc
import pytest

from tessera.v1 import common_pb2, engine_pb2, tokenizer_pb2
from tessera_frontend.output_processor import (MAX_PENDING_STEPS, Failure, OutputCollector, OutputProcessor,
                                               OutputProcessorOutput, RequestState, SampleOutput)
from tessera_frontend.tokenizer_client import DetokenizeStreamError, TokenizeError

pytestmark = pytest.mark.unit

RUNNING = common_pb2.FINISH_REASON_UNSPECIFIED
STOP = common_pb2.FINISH_REASON_STOP
LENGTH = common_pb2.FINISH_REASON_LENGTH
ABORT = common_pb2.FINISH_REASON_ABORT
ERROR = common_pb2.FINISH_REASON_ERROR

from helpers.fakes import EOS, WORDS, FakeDetokenizeStream, FakeTokenizerClient, ids, run_async  # noqa: F401


# -- helpers --------------------------------------------------------------------------------------
def output(request_id: str, tokens: list[int] = (), finish: int = RUNNING, index: int = 0,
           **fields) -> engine_pb2.RequestOutput:
    return engine_pb2.RequestOutput(request_id=request_id, index=index, new_token_ids=tokens,
                                    finish_reason=finish, num_prompt_tokens=3, **fields)


def new_processor() -> tuple[OutputProcessor, FakeTokenizerClient]:
    tokenizer = FakeTokenizerClient()
    return OutputProcessor(tokenizer), tokenizer


def add(processor: OutputProcessor, request_id: str, n: int = 1, stop: list[str] = (),
        include_stop: bool = False, want_token_texts: bool = False) -> RequestState:
    state = RequestState(request_id, n, tokenizer_pb2.DetokenizeOpen(
        stop=stop, include_stop_str_in_output=include_stop, prompt_token_ids=[1, 2, 3]), want_token_texts)
    processor.add_request(state)
    return state


async def feed(processor: OutputProcessor, *outputs: engine_pb2.RequestOutput) -> OutputProcessorOutput:
    """One engine step through the processor: process it, deliver it; the aborts of both calls."""
    first = processor.process_step(engine_pb2.EngineStepOutputs(outputs=outputs))
    second = await asyncio.wait_for(processor.deliver_next(), 1)
    return OutputProcessorOutput(first.reqs_to_abort + second.reqs_to_abort,
                                 first.samples_to_abort + second.samples_to_abort)


def taken(state: RequestState) -> list[SampleOutput]:
    outs = []
    while not state.queue.empty():
        outs.append(state.queue.get_nowait())
    return outs


NOTHING = OutputProcessorOutput()


# -- tests ----------------------------------------------------------------------------------------
@run_async
async def test_tokens_become_text_deltas_until_length():
    processor, tokenizer = new_processor()
    state = add(processor, "r1")
    assert await feed(processor, output("r1", ids("Hello", ","))) == NOTHING
    assert await feed(processor, output("r1", ids(" world"), finish=LENGTH, num_cached_tokens=2)) == NOTHING
    outs = taken(state)
    assert [(o.text, o.token_ids, o.finish_reason) for o in outs] == [
        ("Hello,", ids("Hello", ","), RUNNING), (" world", ids(" world"), LENGTH)]
    assert outs[-1].finished and outs[-1].num_prompt_tokens == 3 and outs[-1].num_cached_tokens == 2
    assert "r1" not in processor and len(processor) == 0
    # The first item opened the request on the stream under its sample key, the last finished it.
    first, last = tokenizer.stream.sent[0][0], tokenizer.stream.sent[-1][0]
    assert first.request_id == "r1#0" and list(first.open.prompt_token_ids) == [1, 2, 3]
    assert not last.HasField("open") and last.finished
    assert tokenizer.stream.cancelled == []  # the tokenizer forgot it on its own


@run_async
async def test_many_requests_share_one_message_per_step():
    processor, tokenizer = new_processor()
    a, b = add(processor, "a"), add(processor, "b")
    await feed(processor, output("a", ids("Hello")), output("b", ids(" the")))
    assert len(tokenizer.stream.sent) == 1 and [i.request_id for i in tokenizer.stream.sent[0]] == ["a#0", "b#0"]
    assert [o.text for o in taken(a)] == ["Hello"] and [o.text for o in taken(b)] == [" the"]


@run_async
async def test_stop_string_finishes_the_request_and_returns_it_to_abort():
    processor, tokenizer = new_processor()
    state = add(processor, "r1", stop=[" end"])
    assert await feed(processor, output("r1", ids("Hello"))) == NOTHING
    # The engine is still running it when the stop string completes mid-step.
    result = await feed(processor, output("r1", ids(" the", " end", " and", " more")))
    assert result.reqs_to_abort == ["r1"] and result.samples_to_abort == []
    outs = taken(state)
    last = outs[-1]
    assert (last.text, last.finish_reason, last.stop_reason, last.stop_token_id) == (" the", STOP, " end", None)
    assert last.token_ids == ids(" the", " end")  # cut at tokens_consumed
    assert "".join(o.text for o in outs) == "Hello the"
    assert "r1" not in processor
    # The engine's late output for it (before the abort lands) is dropped, nothing sent for it.
    messages = len(tokenizer.stream.sent)
    assert processor.process_step(engine_pb2.EngineStepOutputs(
        outputs=[output("r1", ids(" more"), finish=ABORT)])) == NOTHING
    assert len(tokenizer.stream.sent) == messages and state.queue.empty()


@run_async
async def test_stop_string_kept_when_asked():
    processor, _ = new_processor()
    state = add(processor, "r1", stop=["!"], include_stop=True)
    await feed(processor, output("r1", ids("Hello", "!", " more")))
    (out,) = taken(state)
    assert (out.text, out.finish_reason, out.stop_reason) == ("Hello!", STOP, "!")


@run_async
async def test_stop_string_on_the_engines_last_step_needs_no_abort():
    processor, _ = new_processor()
    state = add(processor, "r1", stop=[" end"])
    result = await feed(processor, output("r1", ids(" the", " end"), finish=LENGTH))
    assert result == NOTHING  # the engine has finished it already
    assert taken(state)[-1].finish_reason == STOP


@run_async
async def test_n_samples_stop_one_by_one():
    processor, tokenizer = new_processor()
    state = add(processor, "r1", n=2, stop=["!"])
    await feed(processor, output("r1", ids("Hello"), index=0), output("r1", ids(" the"), index=1))
    assert [i.request_id for i in tokenizer.stream.sent[0]] == ["r1#0", "r1#1"]
    # Sample 0 hits the stop string while sample 1 runs on: only sample 0 is to be aborted.
    result = await feed(processor, output("r1", ids("!"), index=0), output("r1", ids(" end"), index=1))
    assert result.reqs_to_abort == []
    assert result.samples_to_abort == [engine_pb2.SampleRef(request_id="r1", index=0)]
    assert "r1" in processor
    # Sample 1 ends by length: the request is done, nothing left to abort.
    assert await feed(processor, output("r1", ids(" more"), finish=LENGTH, index=1)) == NOTHING
    outs = taken(state)
    by_index = {i: [o for o in outs if o.index == i] for i in (0, 1)}
    assert "".join(o.text for o in by_index[0]) == "Hello"
    assert by_index[0][-1].finish_reason == STOP and by_index[0][-1].stop_reason == "!"
    assert "".join(o.text for o in by_index[1]) == " the end more"
    assert by_index[1][-1].finish_reason == LENGTH
    assert "r1" not in processor


@run_async
async def test_n_samples_all_stopped_abort_the_request_once():
    processor, _ = new_processor()
    add(processor, "r1", n=2, stop=["!"])
    result = await feed(processor, output("r1", ids("!"), index=0), output("r1", ids("Hello", "!"), index=1))
    # Sample 0 alone first, then the whole request once sample 1 also stopped.
    assert result.samples_to_abort == [engine_pb2.SampleRef(request_id="r1", index=0)]
    assert result.reqs_to_abort == ["r1"]


@run_async
async def test_finish_reasons_from_the_engine():
    processor, tokenizer = new_processor()
    by_token, aborted, length = add(processor, "tok"), add(processor, "abort"), add(processor, "len")
    await feed(processor, output("tok", ids("Hello", "</s>"), finish=STOP, stop_token_id=EOS),
               output("abort", [], finish=ABORT),
               output("len", ids(" and"), finish=LENGTH))
    (tok,), (ab,), (ln,) = taken(by_token), taken(aborted), taken(length)
    assert (tok.finish_reason, tok.stop_token_id, tok.stop_reason) == (STOP, EOS, None)
    assert (ab.finish_reason, ab.text, ab.token_ids) == (ABORT, "", [])
    assert ln.finish_reason == LENGTH
    # A request aborted before its first token never reached the tokenizer.
    assert [i.request_id for i in tokenizer.stream.sent[0]] == ["tok#0", "len#0"]


@run_async
async def test_logprobs_get_token_texts_and_prompt_logprobs_come_once():
    processor, tokenizer = new_processor()
    state = add(processor, "r1", n=2, want_token_texts=True)

    def position(token_id: int, logprob: float, *top: int) -> common_pb2.PositionLogprobs:
        return common_pb2.PositionLogprobs(
            chosen=common_pb2.TokenLogprob(token_id=token_id, logprob=logprob, rank=1),
            top=[common_pb2.TokenLogprob(token_id=t, logprob=-5.0, rank=2) for t in top])

    prompt = [common_pb2.PositionLogprobs(), position(2, -1.0, 3)]
    await feed(processor,
               output("r1", ids("Hello"), index=0, logprobs=[position(1, -0.5, 4)], prompt_logprobs=prompt),
               output("r1", ids(" the"), index=1, logprobs=[position(5, -math.inf)], prompt_logprobs=prompt))
    out0, out1 = taken(state)
    assert out0.logprobs[0].chosen.token == "Hello" and out0.logprobs[0].top[0].token == "!"
    assert out1.logprobs[0].chosen.token == " the" and out1.logprobs[0].chosen.logprob == -math.inf
    assert out0.prompt_logprobs[1].chosen.token == "," and out0.prompt_logprobs[1].top[0].token == " world"
    assert out1.prompt_logprobs is None  # reported once per request
    assert tokenizer.token_text_calls == 1


@run_async
async def test_logprob_texts_only_when_asked():
    processor, tokenizer = new_processor()
    state = add(processor, "r1")
    lp = common_pb2.PositionLogprobs(chosen=common_pb2.TokenLogprob(token_id=1, logprob=-0.1))
    await feed(processor, output("r1", ids("Hello"), logprobs=[lp]))
    (out,) = taken(state)
    assert out.logprobs[0].chosen.token == "" and tokenizer.token_text_calls == 0


@run_async
async def test_engine_error_fails_the_request_and_aborts_its_running_samples():
    processor, tokenizer = new_processor()
    state = add(processor, "r1", n=2)
    await feed(processor, output("r1", ids("Hello"), index=0), output("r1", ids(" the"), index=1))
    error = common_pb2.RequestError(code="RESOURCE_EXHAUSTED", message="no KV cache")
    result = processor.process_step(engine_pb2.EngineStepOutputs(
        outputs=[output("r1", [], finish=ERROR, index=0, error=error)]))
    assert result.reqs_to_abort == ["r1"]  # sample 1 was still running in the engine
    failed = taken(state)[-1]
    assert failed.failure == Failure(grpc.StatusCode.RESOURCE_EXHAUSTED, "no KV cache")
    assert failed.finish_reason == ERROR
    assert sorted(tokenizer.stream.cancelled) == ["r1#0", "r1#1"]
    assert "r1" not in processor


@run_async
async def test_engine_error_of_a_single_sample_request_needs_no_abort():
    processor, _ = new_processor()
    state = add(processor, "r1")
    result = processor.process_step(engine_pb2.EngineStepOutputs(outputs=[output("r1", [], finish=ERROR)]))
    assert result == NOTHING
    assert taken(state)[-1].failure.code == grpc.StatusCode.INTERNAL  # no code given: INTERNAL


@run_async
async def test_release_returns_the_request_to_abort_while_the_engine_runs_it():
    processor, tokenizer = new_processor()
    add(processor, "r1")
    await feed(processor, output("r1", ids("Hello")))
    assert processor.release("r1") == OutputProcessorOutput(reqs_to_abort=["r1"])
    assert tokenizer.stream.cancelled == ["r1#0"] and "r1" not in processor
    assert processor.release("r1") == NOTHING  # already gone
    add(processor, "r2")
    await feed(processor, output("r2", ids("Hello"), finish=LENGTH))
    assert processor.release("r2") == NOTHING  # finished: nothing to abort or cancel
    assert tokenizer.stream.cancelled == ["r1#0"]


@run_async
async def test_released_request_gets_no_more_outputs():
    processor, tokenizer = new_processor()
    state = add(processor, "r1")
    tokenizer.stream.answer_at_once = False
    processor.process_step(engine_pb2.EngineStepOutputs(outputs=[output("r1", ids("Hello"))]))
    processor.release("r1")
    tokenizer.stream.answer()
    assert await processor.deliver_next() == NOTHING
    assert state.queue.empty()


@run_async
async def test_fail_reports_lost_requests_without_aborts():
    processor, _ = new_processor()
    state = add(processor, "r1", n=2)
    await feed(processor, output("r1", ids("Hello"), index=0))
    result = processor.fail(["r1", "unknown"], Failure(grpc.StatusCode.UNAVAILABLE, "engine went away"))
    assert result == NOTHING  # the engine no longer runs them
    assert taken(state)[-1].failure == Failure(grpc.StatusCode.UNAVAILABLE, "engine went away")


@run_async
async def test_outputs_wait_while_the_tokenizer_is_down_and_go_out_when_it_is_back():
    processor, tokenizer = new_processor()
    state = add(processor, "r1")
    await feed(processor, output("r1", ids("Hello")))
    tokenizer.stream.down = True
    assert processor.process_step(engine_pb2.EngineStepOutputs(outputs=[output("r1", ids(","))])) == NOTHING
    assert processor.process_step(engine_pb2.EngineStepOutputs(outputs=[output("r1", ids(" the"))])) == NOTHING
    assert [o.text for o in taken(state)] == ["Hello"]  # the rest waits
    tokenizer.stream.reconnect()
    assert await asyncio.wait_for(processor.deliver_next(), 1) == NOTHING  # the resume goes out
    assert await asyncio.wait_for(processor.deliver_next(), 1) == NOTHING  # and its reply comes back
    (resumed,) = tokenizer.stream.sent[-1]
    assert list(resumed.open.resumed_token_ids) == ids("Hello") and resumed.open.resumed_text_chars == 5
    assert list(resumed.new_token_ids) == ids(",", " the")
    outs = taken(state)
    assert [(o.text, o.token_ids) for o in outs] == [(", the", ids(",", " the"))]
    assert await feed(processor, output("r1", ids(" world"), finish=LENGTH)) == NOTHING
    assert [o.text for o in taken(state)] == [" world"]


@run_async
async def test_a_tokenizer_restart_resumes_requests_opened_before_it():
    processor, tokenizer = new_processor()
    state = add(processor, "r1", stop=["the end"])
    await feed(processor, output("r1", ids("Hello", " the")))
    assert "".join(o.text for o in taken(state)) == "Hello the"
    tokenizer.stream.reconnect()  # between two steps: nothing was in flight
    await asyncio.wait_for(processor.deliver_next(), 1)  # (nothing stranded yet)
    assert await feed(processor, output("r1", ids(" world"), finish=LENGTH)) == NOTHING
    (resumed,) = tokenizer.stream.sent[-1]
    assert list(resumed.open.resumed_token_ids) == ids("Hello", " the")
    assert list(resumed.open.stop) == ["the end"]
    assert list(resumed.open.prompt_token_ids) == [1, 2, 3] and resumed.open.resumed_text_chars == 9
    assert [o.text for o in taken(state)] == [" world"]  # no repeated text
    assert tokenizer.stream.cancelled == []


@run_async
async def test_a_tokenizer_down_past_the_timeout_fails_the_request():
    processor, tokenizer = new_processor()
    tokenizer.timeout_s = processor._timeout_s = 0.1
    state = add(processor, "r1")
    tokenizer.stream.down = True
    assert processor.process_step(engine_pb2.EngineStepOutputs(outputs=[output("r1", ids("Hello"))])) == NOTHING
    result = await asyncio.wait_for(processor.deliver_next(), 1)  # the expiry check, after 0.1 s
    assert result.reqs_to_abort == ["r1"]
    failure = taken(state)[-1].failure
    assert failure.code == grpc.StatusCode.UNAVAILABLE and "more than 0.1 s" in failure.message


@run_async
async def test_a_reply_with_the_wrong_number_of_results_fails_the_step():
    processor, tokenizer = new_processor()
    state = add(processor, "r1")
    tokenizer.stream.extra_result = True
    result = await feed(processor, output("r1", ids("Hello")))
    assert result.reqs_to_abort == ["r1"]
    failure = taken(state)[-1].failure
    assert failure.code == grpc.StatusCode.UNAVAILABLE and "2 results for 1 items" in failure.message


@run_async
async def test_detokenize_error_result_fails_the_request():
    processor, tokenizer = new_processor()
    state = add(processor, "r1")
    await feed(processor, output("r1", ids("Hello")))
    tokenizer.stream._open.clear()  # the tokenizer lost it: it answers NOT_FOUND
    result = await feed(processor, output("r1", ids(" the")))
    assert result.reqs_to_abort == ["r1"]
    assert taken(state)[-1].failure == Failure(grpc.StatusCode.NOT_FOUND, "not open")


@run_async
async def test_steps_are_delivered_in_the_order_sent():
    processor, tokenizer = new_processor()
    state = add(processor, "r1")
    tokenizer.stream.answer_at_once = False
    for word in ("Hello", ",", " world"):
        processor.process_step(engine_pb2.EngineStepOutputs(outputs=[output("r1", ids(word))]))
    assert len(tokenizer.stream.sent) == 3 and state.queue.empty()  # sent at once, delivered later
    delivery = asyncio.ensure_future(processor.deliver_next())
    await asyncio.sleep(0)
    assert not delivery.done()  # waits for the tokenizer's reply
    tokenizer.stream.answer()
    await delivery
    await processor.deliver_next()
    await processor.deliver_next()
    assert [o.text for o in taken(state)] == ["Hello", ",", " world"]


@run_async
async def test_throttle_holds_the_reader_past_max_pending_steps():
    processor, tokenizer = new_processor()
    add(processor, "r1")
    tokenizer.stream.answer_at_once = False
    for _ in range(MAX_PENDING_STEPS):
        processor.process_step(engine_pb2.EngineStepOutputs(outputs=[output("r1", ids("Hello"))]))
        await asyncio.wait_for(processor.throttle(), 1)  # up to the limit: no wait
    processor.process_step(engine_pb2.EngineStepOutputs(outputs=[output("r1", ids("Hello"))]))
    held = asyncio.ensure_future(processor.throttle())
    await asyncio.sleep(0.01)
    assert not held.done()
    tokenizer.stream.answer()
    await processor.deliver_next()
    await asyncio.wait_for(held, 1)


@run_async
async def test_a_bug_in_delivery_fails_that_steps_requests_only():
    processor, tokenizer = new_processor()
    broken, fine = add(processor, "broken", want_token_texts=True), add(processor, "fine")

    async def boom(token_ids):
        raise RuntimeError("bug")

    tokenizer.token_texts = boom
    lp = common_pb2.PositionLogprobs(chosen=common_pb2.TokenLogprob(token_id=1))
    result = await feed(processor, output("broken", ids("Hello"), logprobs=[lp]), output("fine", ids("Hello")))
    assert sorted(result.reqs_to_abort) == ["broken", "fine"]
    assert taken(broken)[-1].failure.code == grpc.StatusCode.INTERNAL
    assert taken(fine)[-1].failure.code == grpc.StatusCode.INTERNAL
    # Later steps are delivered again.
    add(processor, "next")
    await feed(processor, output("next", ids(" the")))
    assert processor.release("next").reqs_to_abort == ["next"]


@pytest.mark.parametrize("finish", [LENGTH, STOP, ABORT])
def test_sample_output_finished(finish):
    assert SampleOutput(index=0, finish_reason=finish).finished
    assert not SampleOutput(index=0).finished


# -- a slow consumer ---------------------------------------------------------------------------


def test_a_consumer_that_keeps_up_gets_every_output_and_one_that_falls_behind_gets_them_merged():
    collector = OutputCollector()
    collector.put_nowait(SampleOutput(index=0, text="a", token_ids=[1]))
    assert collector.get_nowait().text == "a" and collector.empty()

    # 2 samples, 500 steps unread: the queue stays bounded, nothing is lost or reordered
    texts = {0: [], 1: []}
    for step in range(500):
        for index in (0, 1):
            text = f"<{index}:{step}>"
            texts[index].append(text)
            collector.put_nowait(SampleOutput(index=index, text=text, token_ids=[step],
                                              finish_reason=LENGTH if step == 499 else RUNNING))
        assert collector.qsize() <= OutputCollector.MAX_WAITING + 2
    collector.put_nowait(SampleOutput(index=0, finish_reason=ERROR, failure=Failure(grpc.StatusCode.UNAVAILABLE, "x")))
    outs = []
    while not collector.empty():
        outs.append(collector.get_nowait())
    assert outs[-1].failure is not None
    for index in (0, 1):
        mine = [o for o in outs[:-1] if o.index == index]
        assert "".join(o.text for o in mine) == "".join(texts[index])
        assert [t for o in mine for t in o.token_ids] == list(range(500))
        assert [o.finished for o in mine] == [False] * (len(mine) - 1) + [True]


@run_async
async def test_collector_get_waits_for_an_output():
    collector = OutputCollector()
    waiter = asyncio.ensure_future(collector.get())
    await asyncio.sleep(0)
    assert not waiter.done()
    collector.put_nowait(SampleOutput(index=0, text="late"))
    assert (await asyncio.wait_for(waiter, 1)).text == "late"

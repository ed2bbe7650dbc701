"""SessionOutbox (the engine's per-session queue of step messages) stays bounded when its
reader falls behind, losing and reordering nothing; and the RequestOutput merge it uses."""
import asyncio
import pytest

from tessera.common.request_outputs import RUNNING, merged_request_output, merged_request_outputs
from tessera.v1 import common_pb2, engine_pb2
from tessera_engine.session_outbox import SessionOutbox

pytestmark = pytest.mark.unit

DONE = object()


def _out(request_id: str, token: int, finish=RUNNING, index: int = 0) -> engine_pb2.RequestOutput:
    out = engine_pb2.RequestOutput(request_id=request_id, index=index, new_token_ids=[token], finish_reason=finish)
    out.logprobs.add().chosen.token_id = token
    return out


def _drain(box: SessionOutbox) -> list:
    async def read():
        items = []
        while True:
            item = await box.get()
            items.append(item)
            if item is DONE:
                return items
    return asyncio.run(read())


def test_unread_steps_stay_bounded_and_fold_in_order():
    box = SessionOutbox()
    sent: dict[tuple[str, int], list[int]] = {("a", 0): [], ("a", 1): [], ("b", 0): []}
    for step in range(500):
        outs = [_out("a", step, index=0), _out("a", 1000 + step, index=1)]
        if step < 300:
            outs.append(_out("b", 2000 + step, finish=common_pb2.FINISH_REASON_LENGTH if step == 299 else RUNNING))
            sent[("b", 0)].append(2000 + step)
        sent[("a", 0)].append(step)
        sent[("a", 1)].append(1000 + step)
        box.put_step(engine_pb2.EngineStepOutputs(outputs=outs))
        assert box.qsize() <= SessionOutbox.MAX_WAITING
        assert box.waiting_outputs() <= 3 * SessionOutbox.MAX_WAITING + 3
    box.put_control(DONE)
    items = _drain(box)
    assert items[-1] is DONE and all(isinstance(i, engine_pb2.EngineStepOutputs) for i in items[:-1])
    got: dict[tuple[str, int], list[int]] = {k: [] for k in sent}
    finishes = []
    for msg in items[:-1]:
        for out in msg.outputs:
            key = (out.request_id, out.index)
            assert not finishes or key != ("b", 0), "an output of b after b finished"
            got[key].extend(out.new_token_ids)
            assert [lp.chosen.token_id for lp in out.logprobs] == list(out.new_token_ids)
            if out.finish_reason != RUNNING:
                finishes.append(key)
    assert got == sent
    assert finishes == [("b", 0)]


def test_a_reader_that_keeps_up_gets_one_message_per_step():
    box = SessionOutbox()

    async def run():
        for step in range(200):
            box.put_step(engine_pb2.EngineStepOutputs(outputs=[_out("a", step)]))
            msg = await box.get()
            assert list(msg.outputs[0].new_token_ids) == [step]
        assert box.qsize() == 0
    asyncio.run(run())


def test_a_new_sample_after_folding_and_a_control_item_come_in_order():
    box = SessionOutbox()
    for step in range(SessionOutbox.MAX_WAITING + 5):
        box.put_step(engine_pb2.EngineStepOutputs(outputs=[_out("a", step)]))
    box.put_step(engine_pb2.EngineStepOutputs(outputs=[_out("c", 7, finish=common_pb2.FINISH_REASON_STOP)]))
    box.put_step(engine_pb2.EngineStepOutputs(outputs=[_out("c", 8)]))  # (never sent by the engine: kept apart)
    box.put_control(DONE)
    items = _drain(box)
    last = items[-2]
    assert [(o.request_id, list(o.new_token_ids)) for o in last.outputs] == [
        ("a", list(range(SessionOutbox.MAX_WAITING - 1, SessionOutbox.MAX_WAITING + 5))), ("c", [7]), ("c", [8])]


def test_merge_keeps_the_later_status_and_the_first_prompt_logprobs():
    first = _out("a", 1)
    first.prompt_logprobs.add()
    first.num_cached_tokens = 16
    later = _out("a", 2, finish=common_pb2.FINISH_REASON_STOP)
    later.stop_token_id = 2
    merged = merged_request_output(first, later)
    assert list(merged.new_token_ids) == [1, 2] and len(merged.logprobs) == 2
    assert merged.finish_reason == common_pb2.FINISH_REASON_STOP and merged.stop_token_id == 2
    assert len(merged.prompt_logprobs) == 1 and merged.num_cached_tokens == 16
    assert list(first.new_token_ids) == [1]  # inputs untouched
    only = merged_request_outputs([first])
    assert only == first and only is not first
    assert list(merged_request_outputs([first, _out("a", 2), _out("a", 3)]).new_token_ids) == [1, 2, 3]

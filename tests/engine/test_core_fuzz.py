"""The engine trusts nothing: random and boundary SamplingParams and token ids, built as a
client's tessera.v1.SamplingParams and converted as the engine's Session converts them,
are either refused with INVALID_ARGUMENT / RESOURCE_EXHAUSTED naming the field or run to
completion; either way the engine keeps serving a good request (hypothesis, tiny model)."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings, strategies as st

from tessera.v1 import common_pb2
from tessera_engine.config import EngineConfig
from tessera_engine.core import EngineCore, RequestRejected
from tessera_engine.request import EngineCoreRequest
from tessera_engine.sampling_params import SamplingParams

from helpers.engine_fixtures import tiny_hf_llama, tiny_loaded

pytestmark = pytest.mark.unit

VOCAB = 256  # tiny_hf_llama's


@pytest.fixture(scope="module")
def core():
    cfg, hf = tiny_hf_llama(max_len=64)
    return EngineCore(EngineConfig(dtype="float32", device="cpu", num_kv_blocks=32, max_num_seqs=8),
                      loaded=tiny_loaded(cfg, hf))


def floats(lo, hi):
    """Ordinary values of a range, its edges and the ones that break naive checks."""
    return st.one_of(st.floats(lo, hi, width=32), st.sampled_from([lo, hi, 0.0, -0.0, -1.0, 1e30, -1e30,
                                                                    math.inf, -math.inf, math.nan]))


def ints(lo, hi):
    return st.one_of(st.integers(lo, hi), st.sampled_from([-1, 0, 1, VOCAB - 1, VOCAB, 2 ** 31 - 1, -2 ** 31]))


token = st.one_of(st.integers(0, VOCAB - 1), st.sampled_from([-1, VOCAB, VOCAB + 1, 2 ** 31 - 1, -2 ** 31]))

params = st.fixed_dictionaries({}, optional={
    "temperature": floats(0.0, 2.0), "top_k": ints(-1, VOCAB), "top_p": floats(0.0, 1.0),
    "min_p": floats(0.0, 1.0), "seed": st.integers(-2 ** 63, 2 ** 63 - 1),
    "repetition_penalty": floats(0.0, 3.0), "presence_penalty": floats(-2.0, 2.0),
    "frequency_penalty": floats(-2.0, 2.0), "max_tokens": ints(1, 8), "min_tokens": ints(0, 8),
    "n": ints(1, 4), "logprobs": ints(0, 30), "prompt_logprobs": ints(0, 30),
    "stop_token_ids": st.lists(token, max_size=3), "ignore_eos": st.booleans()})


def run_to_end(core: EngineCore, limit: int = 200) -> dict:
    out: dict = {}
    for _ in range(limit):
        if not core.has_unfinished():
            return out
        for o in core.step():
            out.setdefault((o.request_id, o.index), []).extend(o.new_token_ids)
    raise AssertionError("the engine did not finish its requests")


# the inputs that once killed the core loop: logprobs past the vocabulary (topk out of
# range), stop / EOS ids outside it while min_tokens masks them, NaN floats, top_k > vocab
@example(fields={"logprobs": 2 ** 31 - 1}, prompt=[1, 2], eos=None)
@example(fields={"prompt_logprobs": VOCAB + 1}, prompt=[1, 2, 3], eos=None)
@example(fields={"stop_token_ids": [VOCAB + 1], "min_tokens": 2, "max_tokens": 3}, prompt=[1], eos=None)
@example(fields={"min_tokens": 2, "max_tokens": 3}, prompt=[1], eos=[-1])
@example(fields={"temperature": math.nan}, prompt=[1], eos=None)
@example(fields={"top_p": math.nan, "temperature": 1.0}, prompt=[1], eos=None)
@example(fields={"top_k": VOCAB + 1, "temperature": 1.0}, prompt=[1], eos=None)
@example(fields={"presence_penalty": math.inf, "temperature": 1.0}, prompt=[1], eos=None)
@example(fields={"n": 2 ** 31 - 1}, prompt=[1], eos=None)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fields=params, prompt=st.lists(token, min_size=0, max_size=12),
       eos=st.one_of(st.none(), st.lists(token, min_size=1, max_size=2)))
def test_any_request_is_refused_clearly_or_served_and_the_engine_keeps_serving(core, fields, prompt, eos):
    pb = common_pb2.SamplingParams(**fields)
    req = EngineCoreRequest("fuzz", list(prompt), SamplingParams.from_proto(pb), eos_token_ids=eos)
    try:
        core.add_request(req)
    except RequestRejected as exc:
        assert exc.code in ("INVALID_ARGUMENT", "RESOURCE_EXHAUSTED") and str(exc)
    else:
        outs = run_to_end(core)
        for (rid, _), toks in outs.items():
            assert all(0 <= t < VOCAB for t in toks)
    assert not core.has_unfinished()
    good = EngineCoreRequest("good", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    core.add_request(good)
    assert run_to_end(core)[("good", 0)].__len__() == 3
    stats = core.stats()
    assert stats.num_blocks_free == stats.num_blocks_total


def test_the_waiting_queue_is_capped_and_the_queued_requests_still_finish():
    """--max-waiting-requests: a request whose samples would take the waiting queue past the
    cap is refused with RESOURCE_EXHAUSTED naming the flag; those queued run to completion and
    the queue takes new requests again once they have started."""
    cfg, hf = tiny_hf_llama(max_len=64)
    core = EngineCore(EngineConfig(dtype="float32", device="cpu", num_kv_blocks=32, max_num_seqs=8,
                                   max_waiting_requests=3), loaded=tiny_loaded(cfg, hf))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    core.add_request(EngineCoreRequest("a", [1, 2, 3], params))
    core.add_request(EngineCoreRequest("b", [4, 5], SamplingParams(temperature=0.0, max_tokens=4, n=2,
                                                                   ignore_eos=True)))
    for rid, n in (("c", 1), ("d", 2)):
        with pytest.raises(RequestRejected) as refused:
            core.add_request(EngineCoreRequest(rid, [6], SamplingParams(temperature=0.0, max_tokens=4, n=n)))
        assert refused.value.code == "RESOURCE_EXHAUSTED" and "--max-waiting-requests 3" in str(refused.value)
    first = core.step()  # all three samples start: the queue is empty again
    core.add_request(EngineCoreRequest("e", [7, 8], params))
    out = run_to_end(core)
    for o in first:
        out[(o.request_id, o.index)] = o.new_token_ids + out.get((o.request_id, o.index), [])
    assert {k: len(v) for k, v in out.items()} == {("a", 0): 4, ("b", 0): 4, ("b", 1): 4, ("e", 0): 4}

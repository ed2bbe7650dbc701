"""The same request gives the same tokens alone, in a batch, from the prefix cache and in
chunks: at the engine's defaults (bfloat16 with the int8 quantized matmul where the CPU has
them), on the default model with the prefix cache on; greedy and seeded sampling alike."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tessera_engine.backend_plan import ALL_ROWS, plan_backends
from tessera_engine.config import EngineConfig
from tessera_engine.core import EngineCore
from tessera_engine.request import EngineCoreRequest
from tessera_engine.sampling_params import SamplingParams

from helpers.engine_fixtures import chat_prompts, hf_tokenizer, model_source  # noqa: F401

pytestmark = [pytest.mark.unit, pytest.mark.slow]

N = 6          # the prompts followed
TOKENS = 40


@pytest.fixture(scope="module")
def default_plan():
    return plan_backends(EngineConfig())


def run(core: EngineCore, prompts, params: SamplingParams, tag: str, cached: list | None = None) -> list[list[int]]:
    """Each prompt's output tokens; `cached` gets each one's prefix-cache hit, in tokens."""
    outs: dict[str, list[int]] = {}
    hits: dict[str, int] = {}
    for i, p in enumerate(prompts):
        core.add_request(EngineCoreRequest(f"{tag}{i}", list(p), params))
    while core.has_unfinished():
        for o in core.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
            hits[o.request_id] = max(hits.get(o.request_id, 0), o.num_cached_tokens)
    if cached is not None:
        cached += [hits[f"{tag}{i}"] for i in range(len(prompts))]
    return [outs[f"{tag}{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True),
                                    SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=TOKENS,
                                                   ignore_eos=True)],
                         ids=["greedy", "seeded"])
def test_a_request_gives_the_same_tokens_alone_batched_cached_and_chunked(default_plan, chat_prompts, params):
    plan, loaded = default_plan
    config = EngineConfig()
    assert plan.batch_invariant, plan.why["batch_invariant"]
    if plan.keep_quantized:
        assert plan.quantized_max_rows == ALL_ROWS
    prompts = chat_prompts[:N]
    alone = [run(EngineCore(config, loaded), [p], params, "a")[0] for p in prompts]
    core = EngineCore(config, loaded)  # one engine, its prefix cache kept: the second pass hits it
    first = [run(core, [p], params, "f")[0] for p in prompts]
    hits: list[int] = []
    cached = [run(core, [p], params, "c", hits)[0] for p in prompts]
    assert all(h >= 16 for h in hits), hits  # the second pass did run on cached blocks
    batched = run(EngineCore(config, loaded), chat_prompts[:32], params, "b")[:N]  # 32 rows a step
    chunked = run(EngineCore(EngineConfig(max_num_batched_tokens=16), loaded), prompts, params, "k")
    for name, got in (("first", first), ("cached", cached), ("batched", batched), ("chunked", chunked)):
        assert got == alone, f"{name}: {sum(a != b for a, b in zip(alone, got))} of {N} differ"


@pytest.fixture(scope="module")
def dense_prompt_plan():
    return plan_backends(EngineConfig(prompt_matmul="dense"))


def test_prompts_on_the_dense_weights_give_the_same_tokens_alone_batched_cached_chunked_and_preempted(
        dense_prompt_plan, chat_prompts):
    """--prompt-matmul dense (auto's choice where the dense matmul computes a prompt chunk faster,
    as with AMX): prompt rows take the decoder layers' dense weights, output rows the quantized
    matmul. The text still depends on the request alone: not on its batch, the prefix cache,
    chunking, a preemption, nor on earlier requests whose outputs a later prompt repeats."""
    plan, loaded = dense_prompt_plan
    if not plan.prompt_dense:
        pytest.skip(plan.why["prompt_matmul"])
    config = EngineConfig(prompt_matmul="dense")
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    prompts = chat_prompts[:N]
    runner = EngineCore(config, loaded).executor.runner
    quantized = EngineCore(dataclasses.replace(config, prompt_matmul="quantized"), loaded).executor.runner
    assert runner.prompt_dense and not quantized.prompt_dense
    # the prompt does take another path: its last position's logits are not the quantized path's
    assert not torch.equal(runner.last_logits(list(prompts[0])), quantized.last_logits(list(prompts[0])))
    del runner, quantized

    alone = [run(EngineCore(config, loaded), [p], params, "a")[0] for p in prompts]
    core = EngineCore(config, loaded)
    first = [run(core, [p], params, "f")[0] for p in prompts]
    hits: list[int] = []
    cached = [run(core, [p], params, "c", hits)[0] for p in prompts]
    assert all(h >= 16 for h in hits), hits
    batched = run(EngineCore(config, loaded), chat_prompts[:32], params, "b")[:N]
    chunked = run(EngineCore(dataclasses.replace(config, max_num_batched_tokens=16), loaded), prompts, params, "k")
    small = EngineCore(dataclasses.replace(config, num_kv_blocks=12), loaded)
    preempted = run(small, prompts, params, "p")
    assert small.scheduler.num_preemptions > 0
    for name, got in (("first", first), ("cached", cached), ("batched", batched), ("chunked", chunked),
                      ("preempted", preempted)):
        assert got == alone, f"{name}: {sum(a != b for a, b in zip(alone, got))} of {N} differ"
    # a prompt that repeats an earlier answer (a chat's next turn): the blocks that answer's
    # outputs filled in `core` hold the quantized path's K/V, so the prompt does not reuse them
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    turns = [list(p) + out for p, out in zip(prompts[:3], alone)]
    fresh = [run(EngineCore(config, loaded), [t], params, "n")[0] for t in turns]
    hits = []
    again = [run(core, [t], params, "r", hits)[0] for t in turns]
    assert all(h < len(p) + 16 for h, p in zip(hits, prompts)), hits
    assert again == fresh


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True),
                                    SamplingParams(temperature=1.0, seed=77, n=2, max_tokens=TOKENS,
                                                   ignore_eos=True, presence_penalty=0.5)],
                         ids=["greedy", "seeded-n2-penalty"])
def test_a_resumed_request_continues_exactly_where_it_stopped(default_plan, chat_prompts, params):
    """What a migration sends another replica: the prompt and each sample's tokens so far. The new
    engine (a fresh one: nothing cached) continues every sample with the tokens it would have
    produced, and counts the resumed ones against max_tokens."""
    _, loaded = default_plan
    config = EngineConfig()
    prompt = list(chat_prompts[1])
    whole: dict[int, list[int]] = {}
    core = EngineCore(config, loaded)
    core.add_request(EngineCoreRequest("w", prompt, params))
    while core.has_unfinished():
        for o in core.step():
            whole.setdefault(o.index, []).extend(o.new_token_ids)
    cut = {0: 15, 1: 22}
    resumed = {i: whole[i][:cut[i]] for i in whole}
    rest: dict[int, list[int]] = {}
    core = EngineCore(config, loaded)
    core.add_request(EngineCoreRequest("m", prompt, params, resumed=resumed))
    while core.has_unfinished():
        for o in core.step():
            rest.setdefault(o.index, []).extend(o.new_token_ids)
    assert {i: resumed[i] + rest[i] for i in rest} == whole


def test_a_bad_resumed_request_is_refused_and_the_running_one_finishes_untouched(default_plan, chat_prompts):
    from tessera_engine.core import RequestRejected

    _, loaded = default_plan
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = run(EngineCore(EngineConfig(), loaded), [chat_prompts[2]], params, "a")[0]
    core = EngineCore(EngineConfig(), loaded)
    core.add_request(EngineCoreRequest("ok", list(chat_prompts[2]), params))
    got = core.step()[0].new_token_ids  # it runs
    for resumed, named in (({3: [1]}, "not one of the request's n = 1"), ({0: list(range(12))}, "has finished"),
                           ({0: [10**7]}, "outside the vocabulary")):
        with pytest.raises(RequestRejected, match=named) as refused:
            core.add_request(EngineCoreRequest("bad", list(chat_prompts[3]), params, resumed=resumed))
        assert refused.value.code == "INVALID_ARGUMENT"
    while core.has_unfinished():
        got += [t for o in core.step() for t in o.new_token_ids]
    assert got == alone


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_decoder_layers_in_cpp_give_the_python_loops_tokens(chat_prompts, dtype):
    """DecoderStack (csrc/decoder_stack.cpp) makes the Python forward's kernel calls from C++: the
    same tokens, bit for bit, alone, batched and chunked; and the plan does use it here."""
    plan, loaded = plan_backends(EngineConfig(dtype=dtype))
    if plan.ops.name != "cpu_kernels" or not plan.keep_quantized:
        pytest.skip(f"no fused CPU kernels with quantized weights here: {plan.why}")
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = chat_prompts[:4]

    def tokens(eager: bool) -> list[list[int]]:
        out = []
        for budget, batch in ((None, prompts[:1]), (None, prompts), (16, prompts[1:3])):
            core = EngineCore(EngineConfig(dtype=dtype, max_num_batched_tokens=budget, enforce_eager=eager), loaded)
            layers = core.executor.runner.model.decoder_layers
            assert layers == "Python loop" if eager else layers.startswith("C++"), layers
            out += run(core, batch, params, "s")
        return out

    assert tokens(eager=False) == tokens(eager=True)

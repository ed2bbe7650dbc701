"""The engine core's greedy output equals HF transformers' generate token for
token on the default model's weights, under batching, prefix caching, chunked
prefill and preemption; aborts free every block; seeded sampling is batch-independent."""
from __future__ import annotations

import pytest

from tessera_engine.request import EngineCoreRequest
from tessera_engine.sampling_params import SamplingParams

from helpers.engine_fixtures import (QUESTIONS, chat_prompts, greedy, hf_greedy, hf_tokenizer, loaded_fp32,  # noqa: F401
                             make_core, model_source, requests)

pytestmark = [pytest.mark.unit, pytest.mark.slow]

MAX_NEW = 24


def assert_matches_hf(outputs, prompts, hf_greedy, max_new=MAX_NEW, prefix="r"):
    for i, p in enumerate(prompts):
        ref = hf_greedy(p, max_new)
        got = outputs[(f"{prefix}{i}", 0)]
        assert got == ref, f"prompt {i}: engine {got} != HF {ref}"


def test_single_prompts_match_hf(make_core, chat_prompts, hf_greedy):
    """Four prompts, one at a time."""
    core = make_core()
    for i, p in enumerate(chat_prompts[:4]):
        out = core.generate([EngineCoreRequest(f"r{i}", p, greedy(MAX_NEW))])
        assert out[(f"r{i}", 0)] == hf_greedy(p, MAX_NEW)


def test_sixteen_mixed_length_prompts_at_once_match_hf(make_core, chat_prompts, hf_greedy):
    lengths = sorted(len(p) for p in chat_prompts)
    assert lengths[-1] - lengths[0] > 40, "prompts should have mixed lengths"
    core = make_core(enable_prefix_caching=False)
    out = core.generate(requests(chat_prompts, greedy(MAX_NEW)))
    assert_matches_hf(out, chat_prompts, hf_greedy)
    assert core.stats().num_blocks_free == core.stats().num_blocks_total


def test_shared_system_prompt_hits_the_prefix_cache_and_matches_hf(make_core, hf_tokenizer, hf_greedy):
    system = ("You are a meticulous assistant for a library. Always answer politely, cite the shelf "
              "number when you know it, and keep answers short. The library opens at nine and closes at "
              "six, has three floors, a reading room, and a children's corner with picture books.")
    prompts = [hf_tokenizer.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": q}],
        add_generation_prompt=True, return_dict=False) for q in QUESTIONS[:6]]
    core = make_core(enable_prefix_caching=True)
    first = core.generate(requests(prompts[:1], greedy(MAX_NEW), prefix="warm"))
    assert first[("warm0", 0)] == hf_greedy(prompts[0], MAX_NEW)
    before = core.stats()
    out = core.generate(requests(prompts, greedy(MAX_NEW)))
    after = core.stats()
    assert_matches_hf(out, prompts, hf_greedy)
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    shared_blocks = (len(system) // 8) // 16  # a loose lower bound on the shared prefix
    assert hits >= 6 * 16 * max(1, shared_blocks // 2), f"expected prefix cache hits, got {hits}"
    assert after.prefix_cache_queries > before.prefix_cache_queries


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["kernels", "torch"])
def test_partial_block_prefix_hits_match_hf(make_core, chat_prompts, hf_greedy, cpu_kernels):
    """The chat prompts share 24 template tokens: one 16-token block and 8 tokens of the next.
    Later prompts take the block and copy the 8 slots from an earlier prompt's second block,
    both in the step that writes that block and in later steps, and still match HF."""
    prompts = [p for p in chat_prompts if len(p) > 32][:6]  # each fills its second block
    assert len(prompts) == 6
    core = make_core(enable_prefix_caching=True, cpu_kernels=cpu_kernels)
    copies = []
    schedule = core.scheduler.schedule

    def recording_schedule():
        out = schedule()
        copies.extend(out.kv_copies)
        return out

    core.scheduler.schedule = recording_schedule
    out = core.generate(requests(prompts[:3], greedy(MAX_NEW)))  # one step admits all three
    assert_matches_hf(out, prompts[:3], hf_greedy)
    assert len(copies) == 2 and all(c.num_tokens >= 8 for c in copies), copies
    out = core.generate(requests(prompts[3:], greedy(MAX_NEW), prefix="later"))
    for i, p in enumerate(prompts[3:]):
        assert out[(f"later{i}", 0)] == hf_greedy(p, MAX_NEW)
    assert len(copies) == 5, copies
    assert core.stats().num_blocks_free == core.stats().num_blocks_total


def test_chunked_prefill_matches_hf(make_core, chat_prompts, hf_greedy):
    core = make_core(max_num_batched_tokens=24, enable_prefix_caching=False)
    prompts = chat_prompts[:8]
    assert max(len(p) for p in prompts) > 24, "the budget must force chunking"
    steps_before = core.step_count
    out = core.generate(requests(prompts, greedy(MAX_NEW)))
    assert_matches_hf(out, prompts, hf_greedy)
    # at 24 tokens per step, the prompts alone need more than one step each
    assert core.step_count - steps_before > sum(len(p) for p in prompts) // 24


def test_preemption_matches_hf(make_core, chat_prompts, hf_greedy):
    # 8 requests of ~40-80 tokens each: 14 blocks cannot hold them all at once
    prompts = chat_prompts[:8]
    core = make_core(num_kv_blocks=14, enable_prefix_caching=False)
    out = core.generate(requests(prompts, greedy(MAX_NEW)))
    assert core.stats().num_preemptions > 0, "the pool was meant to force preemption"
    assert_matches_hf(out, prompts, hf_greedy)
    assert core.stats().num_blocks_free == 14


def test_preemption_with_prefix_caching_matches_hf(make_core, chat_prompts, hf_greedy):
    prompts = chat_prompts[:8]
    core = make_core(num_kv_blocks=14, enable_prefix_caching=True)
    out = core.generate(requests(prompts, greedy(MAX_NEW)))
    assert core.stats().num_preemptions > 0
    assert_matches_hf(out, prompts, hf_greedy)


def test_aborting_half_the_requests_frees_every_block(make_core, chat_prompts):
    core = make_core()
    total = core.stats().num_blocks_total
    for r in requests(chat_prompts, SamplingParams(temperature=0.8, seed=1, max_tokens=64, ignore_eos=True)):
        core.add_request(r)
    for _ in range(5):
        core.step()
    assert core.stats().num_blocks_free < total
    aborted = core.abort_requests([f"r{i}" for i in range(0, 16, 2)])
    assert {o.request_id for o in aborted} == {f"r{i}" for i in range(0, 16, 2)}
    assert all(o.finish_reason == "abort" for o in aborted)
    seen_after_abort = set()
    while core.has_unfinished():
        for o in core.step():
            seen_after_abort.add(o.request_id)
    assert seen_after_abort == {f"r{i}" for i in range(1, 16, 2)}
    assert core.stats().num_blocks_free == total
    assert core.stats().num_running == 0 and core.stats().num_waiting == 0


def test_seeded_sampling_is_independent_of_the_batch(make_core, chat_prompts):
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=20, ignore_eos=True)
    target = chat_prompts[3]
    alone = make_core().generate([EngineCoreRequest("t", target, params)])
    others = requests(chat_prompts[5:12], SamplingParams(temperature=0.7, max_tokens=20))
    mixed = make_core().generate(others[:3] + [EngineCoreRequest("t", target, params)] + others[3:])
    assert alone[("t", 0)] == mixed[("t", 0)]
    # and a different seed gives a different sample
    other_seed = make_core().generate([EngineCoreRequest("t", target, SamplingParams(
        temperature=1.0, top_p=0.9, top_k=50, seed=99, max_tokens=20, ignore_eos=True))])
    assert other_seed[("t", 0)] != alone[("t", 0)]


def test_n_samples_share_prompt_and_differ(make_core, chat_prompts):
    core = make_core()
    out = core.generate([EngineCoreRequest("n", chat_prompts[1], SamplingParams(
        temperature=1.0, seed=7, n=3, max_tokens=16, ignore_eos=True))])
    assert sorted(out) == [("n", 0), ("n", 1), ("n", 2)]
    assert all(len(v) == 16 for v in out.values())
    assert len({tuple(v) for v in out.values()}) > 1
    # the later samples found the first one's prompt blocks in the prefix cache
    assert core.stats().prefix_cache_hits > 0


def test_logprobs_and_prompt_logprobs_match_hf(make_core, chat_prompts, model_source):
    import torch
    from transformers import AutoModelForCausalLM

    prompt = chat_prompts[0]
    core = make_core()
    core.add_request(EngineCoreRequest("lp", prompt, greedy(4, logprobs=3, prompt_logprobs=2)))
    outs = []
    while core.has_unfinished():
        outs.extend(core.step())
    hf = AutoModelForCausalLM.from_pretrained(model_source.directory, gguf_file=model_source.gguf_file,
                                              dtype=torch.float32).eval()
    tokens = [t for o in outs for t in o.new_token_ids]
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + tokens])).logits[0].float()
    ref = torch.log_softmax(logits, dim=-1)
    first = outs[0]
    assert first.prompt_logprobs is not None and len(first.prompt_logprobs) == len(prompt)
    assert first.prompt_logprobs[0] is None
    for pos in range(1, len(prompt)):
        tok, lp, rank, top_ids, top_lps = first.prompt_logprobs[pos]
        assert tok == prompt[pos]
        assert lp == pytest.approx(ref[pos - 1, tok].item(), abs=1e-3)
        assert len(top_ids) == 2 and top_ids[0] == int(ref[pos - 1].argmax())
    for step, o in enumerate(outs):
        (tok, lp, rank, top_ids, top_lps), = o.logprobs
        row = ref[len(prompt) - 1 + step]
        assert rank == 1 and tok == int(row.argmax())  # greedy picks the top token
        assert lp == pytest.approx(row[tok].item(), abs=1e-3)
        assert top_ids[0] == tok and len(top_ids) == 3


def test_refuses_too_long_and_bad_ids(make_core):
    from tessera_engine.core import RequestRejected

    core = make_core(max_model_len=64)
    with pytest.raises(RequestRejected, match="max_model_len"):
        core.add_request(EngineCoreRequest("long", [1] * 60, greedy(8)))
    with pytest.raises(RequestRejected, match="outside the vocabulary"):
        core.add_request(EngineCoreRequest("bad", [1, 10 ** 6], greedy(8)))
    with pytest.raises(RequestRejected, match="empty"):
        core.add_request(EngineCoreRequest("empty", [], greedy(8)))
    with pytest.raises(RequestRejected, match="temperature"):
        core.add_request(EngineCoreRequest("t", [1, 2], SamplingParams(temperature=-1)))
    core.add_request(EngineCoreRequest("ok", [1, 2, 3], greedy(4)))
    with pytest.raises(RequestRejected, match="already running"):
        core.add_request(EngineCoreRequest("ok", [1, 2, 3], greedy(4)))
    assert len(core.generate([])[("ok", 0)]) <= 4


def test_warm_up_before_serving_leaves_no_trace(make_core, chat_prompts, hf_greedy):
    """The service warms a fresh core up (a full-budget prefill and a decode batch over free
    blocks) before serving: every block is still free after, the outputs still equal HF's
    (the garbage K/V it wrote are overwritten before they are read), and a core that has
    taken a request refuses to warm up."""
    core = make_core(enable_prefix_caching=True)
    core.warm_up()
    stats = core.stats()
    assert stats.num_blocks_free == stats.num_blocks_total and stats.prefix_cache_queries == 0
    out = core.generate(requests(chat_prompts[:6], greedy(MAX_NEW)))
    assert_matches_hf(out, chat_prompts[:6], hf_greedy)
    core.add_request(EngineCoreRequest("late", chat_prompts[0], greedy(4)))
    with pytest.raises(RuntimeError, match="before any request"):
        core.warm_up()

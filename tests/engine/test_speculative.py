"""Speculative decoding (tessera_engine.speculative): the n-gram proposer, the configuration, and
the engine's outputs with speculation equal to those without it, greedy and seeded, with prefix
caching, chunked prefill, preemption, stop tokens, max_tokens and requests speculation skips
(logprobs, penalties) in the same batch; by n-gram lookup and by a draft model."""
from __future__ import annotations

import pytest

from tessera_engine.request import EngineCoreRequest
from tessera_engine.sampling_params import SamplingParams
from tessera_engine.speculative import NgramProposer, SpeculativeConfig

from helpers.engine_fixtures import chat_prompts, hf_tokenizer, loaded_fp32, make_core, model_source  # noqa: F401

# a set disable_by_batch_size: speculation in every step of these small batches (the measured
# gate, which decides otherwise, is tested on its own below)
NGRAM = ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2, '
         '"disable_by_batch_size": 16}')
PASSAGE = ("The keeper climbed the stairs at dusk with a brass lantern and a notebook of passing ships. "
           "In forty years he filled sixty notebooks and stacked them on the shelf by his bed. ")


@pytest.mark.unit
def test_ngram_proposals_follow_the_latest_earlier_occurrence_of_the_longest_suffix():
    p = NgramProposer(SpeculativeConfig(prompt_lookup_max=3, prompt_lookup_min=1))
    assert p.propose([1, 2, 3, 4, 5, 9, 2, 3], 2) == [4, 5]          # "2 3" seen before: what followed
    assert p.propose([1, 2, 3, 4, 1, 2, 3, 7, 1, 2, 3], 3) == [7, 1, 2]  # the latest occurrence wins
    assert p.propose([5, 6, 7, 8, 9], 3) == []                        # nothing repeats
    assert p.propose([4, 4], 3) == [4]                                # at most what follows
    assert p.propose([1, 2, 3, 9, 3], 2) == [9, 3]                    # no longer suffix repeats: "3" does
    assert NgramProposer(SpeculativeConfig(prompt_lookup_max=4, prompt_lookup_min=2)).propose([1, 2, 9, 2], 2) == []


@pytest.mark.unit
def test_speculative_config_is_vllm_s_json_and_bad_values_are_named(monkeypatch):
    from tessera_engine.server import config_from_args, parse_args

    c = SpeculativeConfig.parse(NGRAM)
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min) == ("ngram", 4, 4, 2)
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse("") is None
    for bad, named in (('{"method": "medusa"}', "method"), ('{"method": "draft_model"}', "needs a model"),
                       ('{"method": "ngram", "model": "x"}', "draft_model method's"), ('{"num_speculative_tokens": 2}', "method"),
                       ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
                       ('{"method": "ngram", "lookahead": 3}', "lookahead"), ("[1]", "JSON object"),
                       ("{", "not JSON"),
                       ('{"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}', "prompt_lookup_min")):
        with pytest.raises(ValueError, match=named):
            SpeculativeConfig.parse(bad)
    assert config_from_args(parse_args(["--speculative-config", NGRAM])).speculative_config == NGRAM
    monkeypatch.setenv("TESSERA_SPECULATIVE_CONFIG", NGRAM)
    assert config_from_args(parse_args([])).speculative_config == NGRAM
    monkeypatch.setenv("TESSERA_SPECULATIVE_CONFIG", '{"method": "x"}')
    with pytest.raises(SystemExit):
        parse_args([])


@pytest.mark.unit
def test_the_step_cost_gate_speculates_where_guesses_raise_tokens_per_second():
    from tessera_engine.speculative import StepCost, expected_accepted

    # a pass over the weights up to 8 rows, then compute-bound: time grows with rows
    cost = StepCost({1: 4.0, 8: 5.0, 64: 35.0, 256: 140.0})
    assert cost(4) == pytest.approx(4.0 + 3 / 7) and cost(512) == pytest.approx(280.0)
    assert expected_accepted(0.0, 4) == 0 and expected_accepted(1.0, 4) == 4
    assert expected_accepted(0.5, 2) == pytest.approx(0.75)
    # one sample, 4 guesses at a 0.7 acceptance: 5 rows cost ~1.2x one, ~1.9 tokens more
    assert cost.pays(1, 4, expected_accepted(0.7, 4), 1)
    assert not cost.pays(1, 4, expected_accepted(0.05, 4), 1)  # guesses that keep failing
    # 64 samples: even every guess accepted does not pay for 5x the rows
    assert not cost.pays(64, 256, 256, 64)


@pytest.mark.unit
def test_a_large_batch_makes_no_guesses_under_the_measured_gate(make_core, chat_prompts):
    from tessera_engine.speculative import StepCost

    core = make_core(speculative_config='{"method": "ngram", "prompt_lookup_min": 1}')
    assert core.scheduler.step_cost is not None  # measured at start
    core.scheduler.step_cost = StepCost({1: 4.0, 8: 5.0, 64: 35.0, 256: 140.0})
    prompts = [list(p) + [13, 14, 15, 13, 14, 15, 13, 14] for p in chat_prompts[:40]]
    _, totals = _run(core, prompts, lambda i: SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert totals["guessed"] == 0, totals


def _prompts(hf_tokenizer, chat_prompts) -> list[list[int]]:
    """Prompts whose answers repeat their input (the guesses hit), and plain chat questions."""
    grounded = [hf_tokenizer.apply_chat_template(
        [{"role": "user", "content": PASSAGE * 2 + f"\n{task} the passage above."}], add_generation_prompt=True,
        return_dict=False) for task in ("Repeat", "Correct the spelling of", "Summarise")]
    return grounded + [list(p) for p in chat_prompts[:3]]


def _run(core, prompts, params_for) -> tuple[dict, dict]:
    """Every sample's tokens, and the step totals (drafts, guessed, accepted)."""
    for i, p in enumerate(prompts):
        core.add_request(EngineCoreRequest(f"r{i}", p, params_for(i)))
    tokens: dict[str, list[int]] = {}
    totals = {"drafts": 0, "guessed": 0, "accepted": 0}
    while core.has_unfinished():
        step = core.run_step()
        totals["drafts"] += step.iteration.num_drafts
        totals["guessed"] += step.iteration.num_draft_tokens
        totals["accepted"] += step.iteration.num_accepted_tokens
        for o in step.outputs:
            tokens.setdefault(f"{o.request_id}#{o.index}", []).extend(o.new_token_ids)
    return tokens, totals


def _mixed_params(i: int) -> SamplingParams:
    """Greedy, seeded sampling, and requests speculation leaves alone, in one batch."""
    kinds = [dict(temperature=0.0), dict(temperature=0.8, top_p=0.95, seed=11, n=2), dict(temperature=0.0),
             dict(temperature=0.0, logprobs=2), dict(temperature=0.7, seed=5, presence_penalty=0.4),
             dict(temperature=0.0, stop_token_ids=[13], min_tokens=3)]
    return SamplingParams(max_tokens=48, **kinds[i % len(kinds)])


@pytest.mark.unit
@pytest.mark.parametrize("setting", [dict(), dict(max_num_batched_tokens=24), dict(num_kv_blocks=14)],
                         ids=["plain", "chunked-prefill", "preempting"])
def test_outputs_with_speculation_equal_those_without(make_core, hf_tokenizer, chat_prompts, setting):
    prompts = _prompts(hf_tokenizer, chat_prompts)
    want, _ = _run(make_core(**setting), prompts, _mixed_params)
    core = make_core(speculative_config=NGRAM, **setting)
    got, totals = _run(core, prompts, _mixed_params)
    assert got == want
    assert totals["accepted"] > 0.3 * totals["guessed"] > 0, totals  # the grounded answers took guesses
    if "num_kv_blocks" in setting:
        assert core.scheduler.num_preemptions > 0
    # again on the same engine: prompts from the prefix cache, the same tokens
    again, _ = _run(core, prompts, _mixed_params)
    assert again == want


@pytest.mark.unit
def test_seeded_samples_with_speculation_equal_those_without_over_many_seeds(make_core, hf_tokenizer, chat_prompts):
    """The draws are a function of (seed, sample, position): verified guesses give every seeded
    sample the very tokens plain decoding gives it, so its distribution is the target's."""
    prompts = _prompts(hf_tokenizer, chat_prompts)[:1] * 12

    def params(i):
        return SamplingParams(temperature=1.0, seed=100 + i, max_tokens=24)

    want, _ = _run(make_core(), prompts, params)
    got, totals = _run(make_core(speculative_config=NGRAM), prompts, params)
    assert got == want and totals["accepted"] > 0


def _draft_config(model_source, k: int = 3) -> str:
    """The default model drafting for itself (its guesses are the target's greedy tokens)."""
    path = model_source.directory / model_source.gguf_file
    return f'{{"method": "draft_model", "model": "{path}", "num_speculative_tokens": {k}, "disable_by_batch_size": 16}}'


@pytest.mark.unit
@pytest.mark.parametrize("setting", [dict(), dict(max_num_batched_tokens=24), dict(num_kv_blocks=14)],
                         ids=["plain", "chunked-prefill", "preempting"])
def test_draft_model_outputs_equal_those_without_speculation(make_core, model_source, hf_tokenizer, chat_prompts,
                                                             setting):
    """Guesses from a draft model with its own paged KV cache: greedy and seeded samples keep
    their tokens, in a batch with requests speculation skips; the draft's blocks all come back."""
    prompts = _prompts(hf_tokenizer, chat_prompts)
    want, _ = _run(make_core(**setting), prompts, _mixed_params)
    core = make_core(speculative_config=_draft_config(model_source), **setting)
    drafter = core.scheduler.proposer
    got, totals = _run(core, prompts, _mixed_params)
    assert got == want
    # greedy guesses of the target's own weights: the greedy samples take nearly all of them
    assert totals["accepted"] > 0.6 * totals["guessed"] > 0, totals
    assert not drafter.states and len(drafter.free) == core.executor.num_blocks  # released at finish
    again, _ = _run(core, prompts, _mixed_params)  # the prefix cache's blocks, a fresh draft cache
    assert again == want


@pytest.mark.unit
def test_a_draft_model_with_another_vocabulary_is_refused_naming_both(make_core, tmp_path):
    import transformers as tf

    tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2)).save_pretrained(
        tmp_path, safe_serialization=True)
    spec = f'{{"method": "draft_model", "model": "{tmp_path}"}}'
    with pytest.raises(ValueError, match=r"vocabulary of 160 tokens, the target's has 49152"):
        make_core(speculative_config=spec)


@pytest.mark.unit
@pytest.mark.slow
def test_speculated_sampling_follows_the_target_distribution_chi_square(make_core, model_source, hf_tokenizer):
    """Sampling at temperature 1 with a draft model's guesses (greedy: accepted when the target's
    draw equals them, the rest of the time the draw is another token): the second token, given
    the most common first one, is distributed as the target's softmax (Pearson's chi-square,
    p > 0.001), over 400 seeds. A short plain prompt: each sample's draft catches up on the whole
    prompt (the draft has no prefix cache), and after "Once upon a time" the first token is "," for
    ~93% of draws, the second spread over ~9 tokens of 5+ expected draws each."""
    import torch

    core = make_core(speculative_config=_draft_config(model_source, k=2).replace('"disable_by_batch_size": 16',
                                                                                 '"disable_by_batch_size": 0'))
    prompt = list(hf_tokenizer("Once upon a time")["input_ids"])
    for seed in range(400):
        core.add_request(EngineCoreRequest(f"s{seed}", prompt, SamplingParams(temperature=1.0, seed=seed, max_tokens=3,
                                                                              ignore_eos=True)))
    pairs, guessed = {}, 0
    while core.has_unfinished():
        step = core.run_step()
        guessed += step.iteration.num_draft_tokens
        for o in step.outputs:
            pairs.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert guessed > 0
    firsts = [p[0] for p in pairs.values()]
    mode = max(set(firsts), key=firsts.count)
    seconds = [p[1] for p in pairs.values() if p[0] == mode]
    assert len(seconds) >= 200, len(seconds)
    probs = torch.softmax(core.executor.runner.last_logits(prompt + [mode]).double(), -1)
    expected = probs * len(seconds)
    bins = [int(t) for t in torch.nonzero(expected >= 5).flatten()]
    observed = [seconds.count(t) for t in bins]
    want = [float(expected[t]) for t in bins]
    observed.append(len(seconds) - sum(observed))  # every other token, pooled
    want.append(len(seconds) - sum(want))
    if want[-1] < 5:  # too little left to pool: fold it into the largest bin
        observed[0] += observed.pop()
        want[0] += want.pop()
    chi2 = sum((o - e) ** 2 / e for o, e in zip(observed, want))
    df = len(want) - 1
    assert df >= 2, want
    critical = df * (1 - 2 / (9 * df) + 3.09 * (2 / (9 * df)) ** 0.5) ** 3  # Wilson-Hilferty, p = 0.001
    assert chi2 < critical, (chi2, critical, observed, [round(w, 1) for w in want])


@pytest.mark.unit
def test_logprobs_with_speculation_equal_those_without(make_core, hf_tokenizer, chat_prompts):
    """A request with logprobs speculates too: every token, accepted guess or drawn, comes with
    the logprobs plain decoding gives it (each row is computed as a decode of its position)."""
    prompts = _prompts(hf_tokenizer, chat_prompts)[:3]

    def run(core):
        for i, p in enumerate(prompts):
            core.add_request(EngineCoreRequest(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=40, logprobs=2,
                                                                          stop_token_ids=[13])))
        got, accepted = {}, 0
        while core.has_unfinished():
            step = core.run_step()
            accepted += step.iteration.num_accepted_tokens
            for o in step.outputs:
                assert len(o.logprobs) == len(o.new_token_ids)
                assert [lp.token_id for lp in o.logprobs] == o.new_token_ids
                got.setdefault(o.request_id, []).extend(
                    (lp.token_id, lp.logprob, lp.rank, lp.top_ids, lp.top_logprobs) for lp in o.logprobs)
        return got, accepted

    want, _ = run(make_core())
    got, accepted = run(make_core(speculative_config=NGRAM))
    assert accepted > 0 and got == want

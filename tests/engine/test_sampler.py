"""Unit tests of the engine's sampler and its filters (tessera_engine.sampler)."""
from __future__ import annotations

import math

import pytest
import torch

from tessera_engine.sampler import Sampler

from helpers.engine_requests import make_req

pytestmark = pytest.mark.unit


# -- sampler ---------------------------------------------------------------------------------
def sample(logits, **params):
    reqs = [make_req(f"s{i}", 3, **params) for i in range(logits.shape[0])]
    return Sampler(logits.shape[1], torch.device("cpu"))(logits, reqs)


def test_greedy_and_top_k_one():
    logits = torch.randn(4, 50)
    assert sample(logits.clone(), temperature=0).token_ids == logits.argmax(-1).tolist()
    assert sample(logits.clone(), temperature=1.0, top_k=1).token_ids == logits.argmax(-1).tolist()


def test_top_p_and_min_p_restrict_support():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(200, 1)
    picked = set(sample(logits.clone(), temperature=1.0, top_p=0.7).token_ids)
    assert picked == {0, 1}
    picked = set(sample(logits.clone(), temperature=1.0, min_p=0.5).token_ids)
    assert picked == {0, 1}  # 0.15 < 0.5 * 0.5
    picked = set(sample(logits.clone(), temperature=1.0).token_ids)
    assert picked >= {0, 1, 2}


def test_penalties_and_min_tokens():
    logits = torch.zeros(1, 10)
    logits[0, 3] = 5.0
    logits[0, 2] = 4.0  # the EOS id used by make_req
    # request tokens are 0,1,2 (prompt): repetition penalty pushes 2 down
    r = make_req("p", 3, temperature=0, repetition_penalty=10.0)
    out = Sampler(10, torch.device("cpu"))(logits.clone(), [r])
    assert out.token_ids == [3]
    r = make_req("f", 3, temperature=0, frequency_penalty=2.0, presence_penalty=2.0)
    r.append_output_token(3)
    assert Sampler(10, torch.device("cpu"))(logits.clone(), [r]).token_ids == [2]
    # min_tokens blocks EOS until reached
    logits2 = torch.zeros(1, 10)
    logits2[0, 2] = 9.0
    r = make_req("m", 3, temperature=0, min_tokens=2, max_tokens=5)
    assert Sampler(10, torch.device("cpu"))(logits2.clone(), [r]).token_ids != [2]


def test_logprobs_are_log_softmax_with_rank():
    logits = torch.randn(2, 30)
    out = sample(logits.clone(), temperature=0, logprobs=4)
    ref = torch.log_softmax(logits, -1)
    for i in range(2):
        tok, lp, rank, top_ids, top_lps = out.logprobs[i]
        assert rank == 1 and math.isclose(lp, ref[i, tok].item(), abs_tol=1e-5)
        assert top_ids == ref[i].topk(4).indices.tolist()


def test_seeded_rows_ignore_batch_mates():
    logits = torch.randn(1, 100)
    a = make_req("a", 3, temperature=1.0, seed=5)
    alone = [Sampler(100, torch.device("cpu"))(logits.clone(), [a]).token_ids[0] for _ in range(1)]
    b = make_req("b", 3, temperature=1.0, seed=5)
    batch = torch.cat([torch.randn(3, 100), logits])
    others = [make_req(f"o{i}", 3, temperature=1.0) for i in range(3)]
    mixed = Sampler(100, torch.device("cpu"))(batch, others + [b]).token_ids[3]
    assert alone[0] == mixed


def test_greedy_rows_beside_sampled_and_logprob_rows():
    """A batch mixing plain greedy rows with a seeded sampled row and a logprobs row: the
    greedy rows take the argmax fast path, the others the full path on their rows alone,
    and each row's token is what it gets in a batch of its own."""
    logits = torch.randn(5, 100)
    params = [dict(temperature=0), dict(temperature=1.0, seed=3), dict(temperature=0),
              dict(temperature=0, logprobs=2), dict(temperature=0, logit_bias={7: 100.0})]
    batch = Sampler(100, torch.device("cpu"))(logits.clone(), [make_req(f"r{i}", 3, **p) for i, p in enumerate(params)])
    for i, p in enumerate(params):
        alone = Sampler(100, torch.device("cpu"))(logits[i:i + 1].clone(), [make_req(f"r{i}", 3, **p)])
        assert batch.token_ids[i] == alone.token_ids[0]
        assert (batch.logprobs[i] is None) == ("logprobs" not in p)
    assert batch.token_ids[4] == 7 and batch.token_ids[0] == int(logits[0].argmax())


def test_draws_are_keyed_on_seed_sample_and_position_only():
    from tessera_engine.sampler import counter_uniform

    assert counter_uniform(7, 0, 3) == counter_uniform(7, 0, 3)
    assert len({counter_uniform(7, i, p) for i in range(4) for p in range(50)}) == 200
    assert counter_uniform(7, 0, 3) != counter_uniform(8, 0, 3)
    assert all(0.0 <= counter_uniform(s, 1, 2) < 1.0 for s in range(-50, 50))
    # the same seed continues at the sample's output position, however it got there (e.g. a
    # request resumed with its earlier outputs on another replica)
    logits = torch.randn(1, 1000)
    a = make_req("a", 3, temperature=1.0, seed=11)
    for t in (5, 6, 7):
        a.append_output_token(t)
    b = make_req("b", 3, temperature=1.0, seed=11)
    sampler = Sampler(1000, torch.device("cpu"))
    firsts = {sampler(logits.clone(), [b]).token_ids[0] for _ in range(3)}  # position 0, three times
    for t in (5, 6, 7):
        b.append_output_token(t)
    assert len(firsts) == 1
    assert sampler(logits.clone(), [a]).token_ids == sampler(logits.clone(), [b]).token_ids


def test_draws_follow_the_distribution_chi_square():
    """20,000 seeded rows of one distribution (after temperature): the counts per token fit it
    (Pearson's chi-square, 7 degrees of freedom, under 24.32: p > 0.001; the draws are a pure
    function of the seeds, so the check is deterministic)."""
    probs = torch.tensor([0.30, 0.20, 0.15, 0.12, 0.10, 0.07, 0.04, 0.02])
    temperature = 0.8
    logits = (probs.log() * temperature).unsqueeze(0).repeat(20000, 1)  # / 0.8 gives back log(probs)
    reqs = [make_req(f"s{i}", 3, temperature=temperature, seed=1000 + i) for i in range(20000)]
    tokens = torch.tensor(Sampler(8, torch.device("cpu"))(logits, reqs).token_ids)
    counts = torch.bincount(tokens, minlength=8).double()
    expected = probs.double() * 20000
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 24.32, (chi2, counts.tolist())
    # a token of probability 0 is never drawn
    masked = logits[:2000].clone()
    masked[:, 0] = float("-inf")
    assert 0 not in Sampler(8, torch.device("cpu"))(masked, reqs[:2000]).token_ids

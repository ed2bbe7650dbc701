"""Unit tests of the frontend's replica choice (router), engine address parsing and resolution."""
from __future__ import annotations

import asyncio
import dataclasses
import socket

import pytest

from tessera_frontend.admission import AdmissionController, Overloaded
from tessera_frontend.discovery import (EngineEntry, parse_engine_addr, parse_engine_addrs, resolve_entries,
                                        system_resolve)
from tessera_frontend.router import PrefixIndex, Router, prefix_block_hashes

pytestmark = pytest.mark.unit


@dataclasses.dataclass
class FakeReplica:
    """Stands in for EngineReplica: the router reads only `addr` and `outstanding`."""
    addr: str
    outstanding: int = 0


def prompt(tag: int, length: int = 200) -> list[int]:
    return [tag * 1000 + i for i in range(length)]


# -- router: load -------------------------------------------------------------------------------
def test_least_loaded_wins():
    a, b, c = FakeReplica("a", 3), FakeReplica("b", 1), FakeReplica("c", 2)
    assert Router().choose([a, b, c]) is b


def test_ties_go_round_robin():
    replicas = [FakeReplica("a"), FakeReplica("b"), FakeReplica("c")]
    router = Router()
    chosen = [router.choose(replicas).addr for _ in range(6)]
    assert sorted(chosen) == ["a", "a", "b", "b", "c", "c"]


def test_no_candidates():
    assert Router().choose([], prompt(1)) is None


def test_concurrent_distinct_prompts_spread():
    replicas = [FakeReplica("a"), FakeReplica("b")]
    router = Router()
    for tag in range(8):
        router.choose(replicas, prompt(tag)).outstanding += 1
    assert [r.outstanding for r in replicas] == [4, 4]


# -- router: prefix affinity -----------------------------------------------------------------------
def test_same_prefix_goes_to_the_same_replica():
    a, b = FakeReplica("a"), FakeReplica("b")
    router = Router()
    first = router.choose([a, b], prompt(1))
    other = b if first is a else a
    other.outstanding = 0
    first.outstanding = 2  # busier, but within the imbalance allowance
    for _ in range(5):
        assert router.choose([a, b], prompt(1)) is first
    # A longer prompt sharing the prefix (a follow-up turn) follows it too.
    assert router.choose([a, b], prompt(1) + [7, 8, 9] * 30) is first


def test_affinity_yields_when_much_busier():
    a, b = FakeReplica("a"), FakeReplica("b")
    router = Router(max_imbalance=4)
    first = router.choose([a, b], prompt(1))
    other = b if first is a else a
    first.outstanding = 5
    assert router.choose([a, b], prompt(1)) is other
    # Now both hold the prefix: the less loaded one wins.
    first.outstanding, other.outstanding = 1, 3
    assert router.choose([a, b], prompt(1)) is first


def test_short_shared_head_does_not_pin():
    """A shared head (a chat template) under min_match_fraction of the prompt gives no affinity."""
    a, b = FakeReplica("a"), FakeReplica("b")
    router = Router()
    head = list(range(16))
    first = router.choose([a, b], head + prompt(1, 48))
    first.outstanding = 1
    assert router.choose([a, b], head + prompt(2, 48)) is not first


def test_small_advantage_does_not_pin():
    """Sharing fewer than min_match_tokens (a template and a few common words) is not worth a busier replica."""
    a, b = FakeReplica("a"), FakeReplica("b")
    router = Router(min_match_tokens=128)
    head = list(range(96))
    first = router.choose([a, b], head + prompt(1, 20))
    first.outstanding = 1
    assert router.choose([a, b], head + prompt(2, 20)) is not first


def test_affinity_ignores_replicas_not_offered():
    a, b = FakeReplica("a"), FakeReplica("b")
    router = Router()
    first = router.choose([a, b], prompt(1))
    other = b if first is a else a
    assert router.choose([other], prompt(1)) is other  # the preferred one is down


def test_forget_drops_affinity():
    a, b = FakeReplica("a"), FakeReplica("b")
    router = Router()
    first = router.choose([a, b], prompt(1))
    other = b if first is a else a
    first.outstanding = 1
    router.forget(first.addr)
    assert router.choose([a, b], prompt(1)) is other


def test_prefix_hashes_and_index():
    hashes = prefix_block_hashes(list(range(40)), block_tokens=16)
    assert len(hashes) == 2  # full blocks only
    assert prefix_block_hashes(list(range(32)), 16) == hashes
    assert prefix_block_hashes([99] + list(range(1, 40)), 16)[1] != hashes[1]  # chained

    index = PrefixIndex(capacity_blocks=3)
    index.record(hashes, "a")
    index.record(hashes[:1], "b")
    assert index.match(hashes) == {"a": 2, "b": 1}
    # Recording for "b" refreshed the first block, so the second is now the least recently used.
    index.record(prefix_block_hashes(list(range(100, 132)), 16), "c")
    assert len(index) == 3
    assert index.match(hashes) == {"a": 1, "b": 1}


# -- engine addresses --------------------------------------------------------------------------
@pytest.mark.parametrize("text,entry", [
    ("engine:50053", EngineEntry("engine", 50053)),
    ("engine", EngineEntry("engine", 50053)),
    ("dns:///tessera-engine.ns.svc.cluster.local:7000", EngineEntry("tessera-engine.ns.svc.cluster.local", 7000)),
    ("10.0.0.5:1234", EngineEntry("10.0.0.5", 1234)),
    ("[::1]:1234", EngineEntry("::1", 1234)),
    ("fe80::1", EngineEntry("fe80::1", 50053)),
])
def test_parse_engine_addr(text, entry):
    assert parse_engine_addr(text) == entry


@pytest.mark.parametrize("text", ["", ":50053", "engine:http", "engine:0", "engine:70000", "[::1"])
def test_parse_engine_addr_rejects(text):
    with pytest.raises(ValueError):
        parse_engine_addr(text)


def test_parse_engine_addrs_list():
    assert parse_engine_addrs(" a:1, b:2 ,,a:1") == [EngineEntry("a", 1), EngineEntry("b", 2)]
    with pytest.raises(ValueError):
        parse_engine_addrs(" , ")


def test_system_resolve_literal_and_localhost():
    assert asyncio.run(system_resolve("127.0.0.1", 5)) == ["127.0.0.1:5"]
    assert asyncio.run(system_resolve("::1", 5)) == ["[::1]:5"]
    # localhost may resolve to both families; one engine must not count twice.
    assert asyncio.run(system_resolve("localhost", 5)) in (["127.0.0.1:5"], ["[::1]:5"])


def test_resolve_entries_keeps_last_answer_on_failure():
    answers = {"headless": ["10.0.0.1:9", "10.0.0.2:9"]}

    async def resolver(host: str, port: int) -> list[str]:
        if host not in answers:
            raise socket.gaierror(socket.EAI_NONAME, "unknown")
        return answers[host]

    entries = [EngineEntry("headless", 9), EngineEntry("gone", 9)]
    first = asyncio.run(resolve_entries(entries, resolver, {EngineEntry("gone", 9): ["10.0.0.9:9"]}))
    assert first == {EngineEntry("headless", 9): ["10.0.0.1:9", "10.0.0.2:9"],
                     EngineEntry("gone", 9): ["10.0.0.9:9"]}


# -- admission ---------------------------------------------------------------------------------
def test_admission_counts_and_releases():
    admission = AdmissionController(3)
    one = admission.admit()
    two = admission.admit(2)
    with pytest.raises(Overloaded):
        admission.admit()
    two.release()
    two.release()  # idempotent
    assert admission.in_flight == 1
    with admission.admit(2):
        assert admission.in_flight == 3
    assert admission.in_flight == 1
    with pytest.raises(Overloaded):
        admission.admit(3)  # all or none
    one.release()
    assert admission.in_flight == 0


# -- the Session messages a frontend sends --------------------------------------------------
def test_merged_session_inputs_keep_the_latest_more_coming_hint():
    from tessera.v1 import engine_pb2
    from tessera_frontend.engine_client import _merge_inputs

    first = engine_pb2.SessionInput(add=[engine_pb2.EngineRequest(request_id="a")], more_coming=True)
    _merge_inputs(first, engine_pb2.SessionInput(abort=engine_pb2.AbortRequests(request_ids=["x"])))
    assert first.more_coming  # an abort says nothing about what is coming
    _merge_inputs(first, engine_pb2.SessionInput(add=[engine_pb2.EngineRequest(request_id="b")]))
    assert not first.more_coming  # the last add said the burst is complete
    assert [r.request_id for r in first.add] == ["a", "b"] and list(first.abort.request_ids) == ["x"]


def test_the_same_prompt_under_another_lora_adapter_shares_no_affinity():
    assert prefix_block_hashes(prompt(1)) != prefix_block_hashes(prompt(1), lora_name="sql")
    assert prefix_block_hashes(prompt(1), lora_name="sql") == prefix_block_hashes(prompt(1), lora_name="sql")
    assert prefix_block_hashes(prompt(1), lora_name="sql") != prefix_block_hashes(prompt(1), lora_name="chat")
    a, b = FakeReplica("a"), FakeReplica("b")
    router = Router()
    base = router.choose([a, b], prompt(1))
    base.outstanding += 1  # busier: an adapter request with the same prompt goes to the other one
    other = router.choose([a, b], prompt(1), lora_name="sql")
    assert other is not base
    other.outstanding += 1
    assert router.choose([a, b], prompt(1), lora_name="sql") is other  # its own prefix pins it
    assert router.choose([a, b], prompt(1)) is base

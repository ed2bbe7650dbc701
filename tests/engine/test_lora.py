"""LoRA adapters in the engine (lora.py): PEFT adapters made here with peft, read and checked;
greedy output token for token equal to HF transformers + peft on the same adapter (fp32), on
the tiny families and the default model, several adapters and the base model in one batch,
with chunked prefill, preemption and fewer slots than adapters; the prefix cache never shares
KV between adapters; a row's tokens do not depend on its batch (bfloat16, the CPU kernel)."""
from __future__ import annotations

import json

import pytest
import torch

from helpers.engine_fixtures import chat_prompts, greedy, hf_tokenizer, loaded_fp32, model_source  # noqa: F401
from helpers.engine_requests import make_req, make_scheduler, run_step
from helpers.lora_adapters import PeftGreedy, write_adapter
from helpers.model_families import FAMILIES, PROMPTS, prepared
from tessera_engine.config import EngineConfig
from tessera_engine.core import EngineCore
from tessera_engine.kv_cache import KVCacheManager
from tessera_engine.kv_layout import plan_kv_layout
from tessera_engine.lora import LayerShapes, LoRAError, read_adapter
from tessera_engine.models.loader import load_model
from tessera_engine.request import EngineCoreRequest
from tessera_engine.server import parse_lora_modules

NEW = 12


def run(core: EngineCore, jobs: list[tuple[str, list[int], str]], max_tokens: int = NEW,
        ignore_eos: bool = True) -> dict[str, list[int]]:
    """jobs: (request id, prompt, adapter name or "") -> each request's greedy tokens, all in one batch."""
    out = core.generate([EngineCoreRequest(rid, p, greedy(max_tokens, ignore_eos=ignore_eos), lora_name=lora)
                         for rid, p, lora in jobs])
    return {rid: out[(rid, 0)] for rid, _, _ in jobs}


# -- reading adapters ------------------------------------------------------------------
SHAPES = LayerShapes(num_layers=2, hidden=64, q_size=64, kv_size=32, intermediate=96)


@pytest.fixture(scope="module")
def tiny_llama():
    return prepared("llama")


@pytest.mark.unit
def test_a_peft_adapter_is_read_with_its_scaling(tiny_llama, tmp_path):
    plain = read_adapter("a", str(write_adapter(tiny_llama, tmp_path / "a", r=4, alpha=8)), SHAPES, 16)
    assert plain.rank == 4 and plain.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                        "up_proj", "down_proj"]
    assert len(plain.modules) == 14 and {m.scale for m in plain.modules.values()} == {2.0}
    rs = read_adapter("b", str(write_adapter(tiny_llama, tmp_path / "b", r=16, alpha=8, rslora=True,
                                             targets=("q_proj", "down_proj"), rank_pattern={"down_proj": 8})),
                      SHAPES, 16)
    assert rs.target_modules == ["q_proj", "down_proj"]
    assert rs.modules[(0, "q_proj")].scale == pytest.approx(8 / 4) and rs.modules[(1, "down_proj")].scale == \
        pytest.approx(8 / 8 ** 0.5)
    assert rs.modules[(1, "down_proj")].a.shape == (8, 96)


@pytest.mark.unit
def test_bad_adapters_are_refused_naming_what_is_wrong(tiny_llama, tmp_path):
    good = write_adapter(tiny_llama, tmp_path / "good", r=8)

    def refused(path, max_rank=16, shapes=SHAPES) -> str:
        with pytest.raises(LoRAError) as info:
            read_adapter("x", str(path), shapes, max_rank)
        assert info.value.code == "INVALID_ARGUMENT"
        return str(info.value)

    assert "not a directory" in refused(tmp_path / "nowhere")
    assert "rank 8, over --max-lora-rank 4" in refused(good, max_rank=4)
    lying = tmp_path / "lying"
    lying.mkdir()
    (lying / "adapter_config.json").write_text(json.dumps({**json.loads((good / "adapter_config.json").read_text()),
                                                           "r": 999}))
    (lying / "adapter_model.safetensors").write_bytes((good / "adapter_model.safetensors").read_bytes())
    assert "has rank 8, its config says 999" in refused(lying, max_rank=1000)
    other = LayerShapes(num_layers=2, hidden=32, q_size=32, kv_size=16, intermediate=96)
    assert "this model needs A [r, 96] and B [32, r]" in refused(good, shapes=other)
    assert "the model has 1" in refused(good, shapes=other._replace(num_layers=1, hidden=64, q_size=64, kv_size=32))
    for change, words in (({"use_dora": True}, "DoRA"), ({"bias": "all"}, "bias"),
                          ({"modules_to_save": ["lm_head"]}, "modules_to_save"), ({"peft_type": "IA3"}, "IA3")):
        bad = tmp_path / f"bad{len(words)}{words}"
        bad.mkdir()
        cfg = json.loads((good / "adapter_config.json").read_text())
        (bad / "adapter_config.json").write_text(json.dumps({**cfg, **change}))
        (bad / "adapter_model.safetensors").write_bytes((good / "adapter_model.safetensors").read_bytes())
        assert words in refused(bad)
    (tmp_path / "nosafe").mkdir()
    (tmp_path / "nosafe" / "adapter_config.json").write_text((good / "adapter_config.json").read_text())
    (tmp_path / "nosafe" / "adapter_model.bin").write_bytes(b"")
    assert "adapter_model.bin is not read" in refused(tmp_path / "nosafe")
    (tmp_path / "torn").mkdir()
    (tmp_path / "torn" / "adapter_config.json").write_text((good / "adapter_config.json").read_text())
    (tmp_path / "torn" / "adapter_model.safetensors").write_bytes(b"\x10\x00garbage")
    assert "cannot be read" in refused(tmp_path / "torn")
    embed = write_adapter(tiny_llama, tmp_path / "embed", targets=("embed_tokens", "q_proj"))
    assert "embedding, lm_head and bias adapters are not supported" in refused(embed)


@pytest.mark.unit
def test_lora_modules_flag_takes_name_path_and_vllms_json():
    assert parse_lora_modules(["a=/x/y", '{"name": "b", "path": "/z", "base_model_name": "m"}']) == \
        [("a", "/x/y"), ("b", "/z")]
    for bad in ("noequals", "=/p", "a=", '{"name": "b"}'):
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_modules([bad])


# -- scheduler and prefix cache --------------------------------------------------------
@pytest.mark.unit
def test_the_scheduler_runs_at_most_max_loras_adapters_and_passes_the_others_over():
    s = make_scheduler(max_loras=2)
    adapters = [object(), object(), object()]
    for i, lora in enumerate([adapters[0], adapters[1], adapters[2], None, adapters[0]]):
        req = make_req(f"r{i}", 5, start=10 * i, max_tokens=2)
        req.lora = lora
        s.add_request(req)
    out = run_step(s)
    ran = [x.sample.request_id for x in out.scheduled]
    assert ran == ["r0", "r1", "r3", "r4"]  # r2's adapter would be a third
    run_step(s)  # r0, r1, r3, r4 finish (2 tokens each)
    assert [x.sample.request_id for x in run_step(s).scheduled] == ["r2"]


@pytest.mark.unit
def test_prefix_cache_blocks_are_shared_within_an_adapter_only():
    kv = KVCacheManager(32, 4, True)

    def admitted(rid: str, salt: bytes | None) -> int:
        req = make_req(rid, 13)
        req.cache_salt = salt
        hit = kv.find_cached_prefix(req)
        assert kv.allocate(req, req.num_tokens - hit.num_tokens, hit)  # publishes its full blocks
        return hit.num_tokens

    assert admitted("base", None) == 0
    assert admitted("a1", b"\x01" * 32) == 0      # same tokens, another adapter: nothing shared
    assert admitted("a2", b"\x02" * 32) == 0
    assert admitted("a1-again", b"\x01" * 32) == 12  # its own adapter's blocks
    assert admitted("base-again", None) == 12


# -- equality with HF transformers + peft ------------------------------------------------
@pytest.mark.unit
@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_families_match_hf_peft_in_one_mixed_batch(family, tmp_path):
    hf = prepared(family)
    hf.save_pretrained(tmp_path / "model", safe_serialization=True)
    a1 = write_adapter(hf, tmp_path / "a1", r=8, alpha=16, seed=1, std=0.1)
    a2 = write_adapter(hf, tmp_path / "a2", r=4, alpha=4, seed=2, std=0.15, rslora=True,
                       targets=("q_proj", "v_proj", "o_proj", "down_proj"))
    ref = PeftGreedy(hf)
    jobs, want = [], {}
    for i, p in enumerate(PROMPTS):
        for name, path in (("", None), ("a1", a1), ("a2", a2)):
            jobs.append((f"p{i}{name}", p, name))
            want[f"p{i}{name}"] = ref(path, p, NEW)
    assert want["p0a1"] != want["p0"] and want["p0a2"] != want["p0"]  # the adapters change the output
    loaded = load_model(str(tmp_path / "model"), None, torch.float32, torch.device("cpu"))
    modules = [("a1", str(a1)), ("a2", str(a2))]
    # one batch; chunked prefill (8 tokens a step); preemption (a pool too small for all at
    # once); one slot for two adapters (the least recently used one reloaded)
    # a pool page per KV cache group (the tiny Gemma 3 has 7): the small pool scaled to match
    groups = len(plan_kv_layout(loaded.model.attention_windows).groups)
    for extra in ({}, {"max_num_batched_tokens": 8}, {"num_kv_blocks": 12 * groups, "block_size": 4},
                  {"max_loras": 1}):
        cfg = {"num_kv_blocks": 64, "max_loras": 2, **extra}
        core = EngineCore(EngineConfig(dtype="float32", device="cpu", lora_modules=modules, **cfg), loaded=loaded)
        got = run(core, jobs)
        for rid in want:
            assert got[rid] == want[rid], f"{family}, {rid}, {extra}"
        if extra.get("block_size") == 4:
            assert core.scheduler.num_preemptions > 0
        if extra.get("max_loras") == 1:
            assert core.lora.loads >= 2


@pytest.fixture(scope="module")
def default_hf(model_source):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_source.directory, gguf_file=model_source.gguf_file,
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def default_adapters(default_hf, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    return {"chef": write_adapter(default_hf, root / "chef", r=8, alpha=16, seed=1, std=0.03),
            "pirate": write_adapter(default_hf, root / "pirate", r=16, alpha=16, seed=2, std=0.03, rslora=True,
                                    targets=("q_proj", "k_proj", "v_proj", "o_proj"))}


@pytest.mark.unit
@pytest.mark.slow
def test_default_model_matches_hf_peft_with_two_adapters_and_the_base_in_one_batch(
        default_hf, default_adapters, loaded_fp32, chat_prompts):
    ref = PeftGreedy(default_hf)
    prompts = chat_prompts[:6]
    jobs, want = [], {}
    for i, p in enumerate(prompts):
        name = ["", "chef", "pirate"][i % 3]
        jobs.append((f"q{i}", p, name))
        want[f"q{i}"] = ref(default_adapters.get(name), p, 16)
    base_of_chef = ref(None, prompts[1], 16)
    assert want["q1"] != base_of_chef
    modules = [(k, str(v)) for k, v in default_adapters.items()]
    for extra in ({}, {"max_num_batched_tokens": 32}):
        core = EngineCore(EngineConfig(dtype="float32", device="cpu", kv_cache_gib=0.25, lora_modules=modules,
                                       max_loras=2, **extra), loaded=loaded_fp32)
        got = run(core, jobs, 16, ignore_eos=False)
        for rid in want:
            assert got[rid] == want[rid], (rid, extra)


@pytest.mark.unit
@pytest.mark.slow
def test_bf16_lora_rows_do_not_depend_on_their_batch_and_hit_only_their_adapters_cache(
        default_adapters, chat_prompts):
    """The defaults (bfloat16 where the CPU has it, the kernels, batch-invariant): each request's
    tokens alone equal its tokens in a mixed batch; a repeat hits the prefix cache of its own
    adapter only, and gives the same tokens."""
    modules = [(k, str(v)) for k, v in default_adapters.items()]
    core = EngineCore(EngineConfig(kv_cache_gib=0.25, lora_modules=modules, max_loras=2))
    prompts = chat_prompts[:6]
    jobs = [(f"q{i}", p, ["", "chef", "pirate"][i % 3]) for i, p in enumerate(prompts)]
    alone = {}
    for rid, p, name in jobs:
        alone.update(run(core, [(rid + "-alone", p, name)], 10))
    batched = run(core, jobs, 10)
    for rid, _, _ in jobs:
        assert batched[rid] == alone[rid + "-alone"], rid
    # a prompt nothing ran yet (no chat template: no shared start): computed under "chef", then
    # nothing of it is cached for "pirate" or the base model, all of it for "chef"
    fresh = list(range(1000, 1040))

    def cached(rid: str, name: str) -> tuple[int, list[int]]:
        core.add_request(EngineCoreRequest(rid, fresh, greedy(6, ignore_eos=True), lora_name=name))
        outs = []
        while core.has_unfinished():
            outs += core.step()
        return outs[0].num_cached_tokens, [t for o in outs for t in o.new_token_ids]

    first, tokens = cached("fresh-chef", "chef")
    assert first == 0
    assert cached("fresh-pirate", "pirate")[0] == 0
    assert cached("fresh-base", "")[0] == 0
    hit, again = cached("fresh-chef-again", "chef")
    assert hit == 32 and again == tokens  # its two full blocks


@pytest.mark.unit
@pytest.mark.slow
def test_unknown_adapters_are_refused_and_unloading_lets_running_requests_finish(default_adapters, loaded_fp32,
                                                                                chat_prompts):
    from tessera_engine.core import RequestRejected

    plain = EngineCore(EngineConfig(dtype="float32", device="cpu", kv_cache_gib=0.25), loaded=loaded_fp32)
    with pytest.raises(RequestRejected) as off:
        plain.add_request(EngineCoreRequest("x", chat_prompts[0], greedy(4), lora_name="chef"))
    assert off.value.code == "NOT_FOUND" and "runs without LoRA" in off.value.message
    core = EngineCore(EngineConfig(dtype="float32", device="cpu", kv_cache_gib=0.25, enable_lora=True),
                      loaded=loaded_fp32)
    with pytest.raises(RequestRejected) as info:
        core.add_request(EngineCoreRequest("y", chat_prompts[0], greedy(4), lora_name="chef"))
    assert info.value.code == "NOT_FOUND" and "'chef'" in info.value.message
    core.load_lora(core.lora.read("chef", str(default_adapters["chef"])))
    with pytest.raises(LoRAError) as exists:
        core.load_lora(core.lora.read("chef", str(default_adapters["chef"])))
    assert exists.value.code == "ALREADY_EXISTS"
    core.add_request(EngineCoreRequest("z", chat_prompts[0], greedy(6, ignore_eos=True), lora_name="chef"))
    core.step()
    core.unload_lora("chef")  # running: it finishes with its adapter
    tokens = []
    while core.has_unfinished():
        tokens += [t for o in core.step() for t in o.new_token_ids]
    assert len(tokens) >= 5
    with pytest.raises(RequestRejected):
        core.add_request(EngineCoreRequest("w", chat_prompts[0], greedy(4), lora_name="chef"))
    with pytest.raises(LoRAError) as gone:
        core.unload_lora("chef")
    assert gone.value.code == "NOT_FOUND"


@pytest.mark.unit
def test_lora_requests_info_keeps_one_series_naming_the_running_and_waiting_adapters():
    from prometheus_client import CollectorRegistry

    from tessera_engine.metrics import EngineMetrics
    from tessera_engine.outputs import EngineStats

    reg = CollectorRegistry()
    m = EngineMetrics("m", 128, block_size=16, num_blocks=8, enable_prefix_caching=True, registry=reg)
    m.max_lora = 2
    for running, waiting in ((("a",), ()), (("a", "b"), ("c",))):
        m.record_step(EngineStats(2, 1, 8, 4, 0, 0, 0, 0.5, running, waiting), None)
    series = [s for metric in reg.collect() if metric.name == "tessera:lora_requests_info" for s in metric.samples]
    assert [s.labels for s in series] == [{"running_lora_adapters": "a,b", "waiting_lora_adapters": "c",
                                           "max_lora": "2"}]
    assert series[0].value > 0

"""LoRA adapters through the real services, as vLLM's OpenAI server serves them: the `openai`
client and raw HTTP (httpx2, the client openai uses) on the HTTP API, the gRPC FrontendService.

One stack for the module, started once: the tokenizer, two engine replicas (each with
`--lora-modules chef=... pirate=... --max-loras 2`, one compute thread each, as
tests/stack/test_replicas.py runs two engines on one machine), a frontend over both with
`--allow-runtime-lora-updating true` and a second frontend over both without it. The adapters
are random PEFT adapters made here for the default model's architecture (weights don't
matter for an adapter: only its shapes must fit). The last test kills an engine.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import pathlib
import time

import grpc
import httpx2
import openai
import pytest

from helpers.lora_adapters import write_adapter
from helpers.metrics_util import json_lines
from helpers.stack import Service, all_serving, free_port, frontend_service
from tessera import serve
from tessera.common.model_source import resolve_model
from tessera.v1 import common_pb2, engine_pb2_grpc, frontend_pb2, frontend_pb2_grpc, tokenizer_pb2
from tessera_frontend.lora import REFRESH_MIN_S

QUESTION = "Describe the sea in one sentence."
MAX_TOKENS = 16


@dataclasses.dataclass
class LoRAStack:
    base: str                       # the base model's name
    adapters: dict[str, pathlib.Path]
    broken: dict[str, pathlib.Path]  # adapter directories the engine must refuse, by what is wrong
    engines: list[Service]
    frontend: Service               # --allow-runtime-lora-updating true
    plain: Service                  # without it
    client: openai.OpenAI           # on `frontend`
    http: httpx2.Client             # on `frontend`
    plain_http: httpx2.Client
    stub: frontend_pb2_grpc.FrontendServiceStub
    plain_stub: frontend_pb2_grpc.FrontendServiceStub
    engine_stubs: list[engine_pb2_grpc.EngineServiceStub]

    def chat(self, model: str, stream: bool = False, max_tokens: int = MAX_TOKENS) -> str:
        """The greedy answer to QUESTION from `model` (a base or adapter name), streamed or whole."""
        kwargs = dict(model=model, messages=[{"role": "user", "content": QUESTION}], temperature=0,
                      max_tokens=max_tokens, extra_body={"ignore_eos": True})
        if not stream:
            reply = self.client.chat.completions.create(**kwargs)
            assert reply.model == model
            return reply.choices[0].message.content
        chunks = list(self.client.chat.completions.create(stream=True, **kwargs))
        assert chunks and all(c.model == model for c in chunks)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    def engine_adapters(self) -> list[list[str]]:
        """Each engine replica's adapter names, asked of the engine itself."""
        return [[a.name for a in stub.ListLoRAAdapters(common_pb2.ListLoRAAdaptersRequest(), timeout=10).adapters]
                for stub in self.engine_stubs]


def _base_hf_model():
    from transformers import AutoConfig, AutoModelForCausalLM

    src = resolve_model(None)
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src.directory, gguf_file=src.gguf_file))


def _broken_adapters(hf, good: pathlib.Path, root: pathlib.Path) -> dict[str, pathlib.Path]:
    """Adapter directories the engine must refuse: rank 32 over --max-lora-rank 16, a config
    without its weights, no directory at all."""
    over_rank = write_adapter(hf, root / "over-rank", r=32, seed=4)
    config = json.loads((good / "adapter_config.json").read_text())
    no_weights = root / "no-weights"
    no_weights.mkdir()
    (no_weights / "adapter_config.json").write_text(json.dumps(config))
    return {"over_rank": over_rank, "no_weights": no_weights, "no_directory": root / "nowhere"}


def _wait_sessions(frontend: Service, engines: list[Service], seconds: float = 120) -> None:
    """Until the frontend has a session open to every engine (SERVING needs one only)."""
    deadline = time.monotonic() + seconds
    want = {e.addr for e in engines}
    while {e.get("engine") for e in json_lines(frontend.log_path) if e.get("msg") == "engine session open"} < want:
        assert time.monotonic() < deadline, f"not every engine session opened:\n{frontend.log_tail()}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    hf = _base_hf_model()
    adapters = {name: write_adapter(hf, root / name, r=r, seed=seed)
                for name, r, seed in (("chef", 8, 1), ("pirate", 16, 2), ("poet", 8, 3))}
    broken = _broken_adapters(hf, adapters["chef"], root)
    del hf
    log_dir = root / "logs"
    log_dir.mkdir()
    engine_args = ["--lora-modules", f"chef={adapters['chef']}", f"pirate={adapters['pirate']}",
                   "--max-loras", "2", "--max-lora-rank", "16", "--num-threads", "1"]
    tokenizer = Service("tokenizer", "tessera_tokenizer", free_port(), [], log_dir / "tokenizer.log")
    engines = [Service(f"engine-{x}", "tessera_engine", free_port(), engine_args, log_dir / f"engine-{x}.log")
               for x in "ab"]
    addrs = ",".join(e.addr for e in engines)
    frontend = frontend_service("frontend", tokenizer.addr, addrs, log_dir, "--allow-runtime-lora-updating", "true",
                                "--engine-timeout-s", "5")
    plain = frontend_service("frontend-plain", tokenizer.addr, addrs, log_dir)
    with all_serving(tokenizer, *engines, frontend, plain):
        for one in (frontend, plain):
            _wait_sessions(one, engines)
        channels = [grpc.insecure_channel(s.addr) for s in (frontend, plain, *engines)]
        http, plain_http = (httpx2.Client(base_url=s.http_url, timeout=180) for s in (frontend, plain))
        try:
            client = openai.OpenAI(base_url=frontend.http_url + "/v1", api_key="unused", max_retries=0, timeout=180)
            base = client.models.list().data[0].id
            yield LoRAStack(base, adapters, broken, engines, frontend, plain, client, http, plain_http,
                            frontend_pb2_grpc.FrontendServiceStub(channels[0]),
                            frontend_pb2_grpc.FrontendServiceStub(channels[1]),
                            [engine_pb2_grpc.EngineServiceStub(c) for c in channels[2:]])
        finally:
            http.close()
            plain_http.close()
            for channel in channels:
                channel.close()


def grpc_request(lora_name: str, request_id: str = "", max_tokens: int = MAX_TOKENS) -> frontend_pb2.GenerateRequest:
    chat = tokenizer_pb2.ChatMessages(messages=[tokenizer_pb2.ChatMessage(role="user", content=QUESTION)])
    return frontend_pb2.GenerateRequest(
        request_id=request_id, chat=chat, lora_name=lora_name,
        sampling_params=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))


def _error(reply: httpx2.Response, status: int) -> dict:
    assert reply.status_code == status, reply.text
    return reply.json()["error"]


# -- serving adapters ------------------------------------------------------------------------------
@pytest.mark.integration
def test_models_list_the_adapters_with_their_parent(lora):
    assert [m.id for m in lora.client.models.list().data] == [lora.base, "chef", "pirate"]
    cards = lora.http.get("/v1/models").json()["data"]
    chef = cards[1]
    assert chef["root"] == str(lora.adapters["chef"]) and chef["parent"] == lora.base
    assert chef["object"] == "model" and chef["owned_by"] == "tessera"
    assert chef["max_model_len"] == cards[0]["max_model_len"] > 0
    assert lora.http.get("/v1/models/pirate").json()["parent"] == lora.base
    listed = lora.stub.ListLoRAAdapters(common_pb2.ListLoRAAdaptersRequest(), timeout=10)
    assert [(a.name, a.rank) for a in listed.adapters] == [("chef", 8), ("pirate", 16)]
    assert listed.enabled and (listed.max_loras, listed.max_lora_rank) == (2, 16)
    assert "q_proj" in listed.adapters[0].target_modules


@pytest.mark.integration
def test_grpc_list_models_lists_the_adapters_with_their_parent(lora):
    models = lora.stub.ListModels(frontend_pb2.ListModelsRequest(), timeout=10).models
    assert [(m.id, m.parent) for m in models] == [(lora.base, ""), ("chef", lora.base), ("pirate", lora.base)]
    assert models[1].root == str(lora.adapters["chef"])
    assert models[1].max_model_len == models[0].max_model_len > 0
    info = lora.stub.GetServerInfo(frontend_pb2.GetServerInfoRequest(), timeout=10)
    assert info.allow_runtime_lora_updating and info.model == lora.base


@pytest.mark.integration
def test_an_adapter_answers_streamed_and_differently_from_the_base_model(lora):
    chef = lora.chat("chef", stream=True)
    assert chef and chef == lora.chat("chef")
    base = lora.chat(lora.base, stream=True)
    pirate = lora.chat("pirate", stream=True)
    assert len({base, chef, pirate}) == 3, (base, chef, pirate)
    # raw SSE: the adapter's name in every chunk, then [DONE]
    with lora.http.stream("POST", "/v1/chat/completions", json={
            "model": "pirate", "messages": [{"role": "user", "content": QUESTION}], "temperature": 0,
            "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True}) as reply:
        assert reply.status_code == 200
        events = [line[len("data: "):] for line in reply.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["model"] for c in chunks} == {"pirate"}
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == pirate


@pytest.mark.integration
def test_adapters_and_the_base_model_at_once_answer_as_alone(lora):
    models = [lora.base, "chef", "pirate"]
    alone = {m: lora.chat(m) for m in models}
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futures = [(m, pool.submit(lora.chat, m)) for m in models * 2]
        for model, future in futures:
            assert future.result() == alone[model], model


@pytest.mark.integration
def test_an_unknown_model_is_404_naming_it(lora):
    for create in (lambda: lora.client.chat.completions.create(model="gpt-9", messages=[{"role": "user",
                                                                                        "content": "hi"}]),
                   lambda: lora.client.completions.create(model="gpt-9", prompt="hi")):
        with pytest.raises(openai.NotFoundError) as info:
            create()
        error = info.value.body
        assert error["code"] == "model_not_found" and error["param"] == "model"
        assert "`gpt-9`" in error["message"] and "`chef`" in error["message"]
    assert _error(lora.http.get("/v1/models/gpt-9"), 404)["code"] == "model_not_found"


@pytest.mark.integration
def test_grpc_generate_runs_with_the_named_adapter(lora):
    responses = list(lora.stub.Generate(grpc_request("chef"), timeout=120))
    assert len(responses) > 1  # streamed
    assert "".join(r.text for r in responses) == lora.chat("chef")
    assert responses[-1].usage.completion_tokens == MAX_TOKENS
    result = lora.stub.Complete(grpc_request(""), timeout=120)
    assert result.choices[0].text == lora.chat(lora.base)
    with pytest.raises(grpc.RpcError) as info:
        list(lora.stub.Generate(grpc_request("nope"), timeout=30))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and "'nope'" in info.value.details()


# -- run-time updates ------------------------------------------------------------------------------
@pytest.mark.integration
def test_an_adapter_loaded_at_run_time_serves_until_it_is_unloaded(lora):
    path = str(lora.adapters["poet"])
    reply = lora.http.post("/v1/load_lora_adapter", json={"lora_name": "poet", "lora_path": path})
    assert reply.status_code == 200 and reply.text == "Success: LoRA adapter 'poet' added successfully."
    assert all("poet" in names for names in lora.engine_adapters())  # on every replica
    assert [m.id for m in lora.client.models.list().data] == [lora.base, "chef", "pirate", "poet"]
    poet = lora.chat("poet", stream=True)
    assert poet and poet not in (lora.chat(lora.base), lora.chat("chef"))
    assert "already" in _error(lora.http.post("/v1/load_lora_adapter", json={"lora_name": "poet",
                                                                              "lora_path": path}), 400)["message"]

    reply = lora.http.post("/v1/unload_lora_adapter", json={"lora_name": "poet"})
    assert reply.status_code == 200 and reply.text == "Success: LoRA adapter 'poet' removed successfully."
    assert not any("poet" in names for names in lora.engine_adapters())
    with pytest.raises(openai.NotFoundError) as info:
        lora.chat("poet")
    assert "`poet`" in info.value.body["message"]
    assert "'poet'" in _error(lora.http.post("/v1/unload_lora_adapter", json={"lora_name": "poet"}), 404)["message"]

    # the same through gRPC
    loaded = lora.stub.LoadLoRAAdapter(common_pb2.LoadLoRAAdapterRequest(lora_name="poet", lora_path=path), timeout=120)
    assert (loaded.name, loaded.path, loaded.rank) == ("poet", path, 8)
    assert "".join(r.text for r in lora.stub.Generate(grpc_request("poet"), timeout=120)) == poet
    assert lora.stub.UnloadLoRAAdapter(common_pb2.UnloadLoRAAdapterRequest(lora_name="poet"), timeout=30).name == "poet"
    with pytest.raises(grpc.RpcError) as info:
        lora.stub.UnloadLoRAAdapter(common_pb2.UnloadLoRAAdapterRequest(lora_name="poet"), timeout=30)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.integration
def test_broken_adapters_are_refused_and_the_others_still_serve(lora):
    chef = lora.chat("chef")
    messages = {}
    for what, path in lora.broken.items():
        error = _error(lora.http.post("/v1/load_lora_adapter", json={"lora_name": what, "lora_path": str(path)}), 400)
        assert error["message"] and error["type"] == "invalid_request_error"
        messages[what] = error["message"]
    assert "over --max-lora-rank 16" in messages["over_rank"], messages
    assert "safetensors" in messages["no_weights"], messages
    missing = _error(lora.http.post("/v1/load_lora_adapter", json={"lora_name": "x"}), 400)
    assert missing["message"] == "lora_path is required" and missing["param"] == "lora_path"
    assert _error(lora.http.post("/v1/load_lora_adapter", content=b"{not json"), 400)["message"]
    with pytest.raises(grpc.RpcError) as info:
        lora.stub.LoadLoRAAdapter(common_pb2.LoadLoRAAdapterRequest(
            lora_name="x", lora_path=str(lora.broken["over_rank"])), timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "rank 32" in info.value.details()

    assert lora.engine_adapters() == [["chef", "pirate"]] * 2
    assert [m.id for m in lora.client.models.list().data] == [lora.base, "chef", "pirate"]
    assert lora.chat("chef") == chef


@pytest.mark.integration
def test_an_adapter_only_one_replica_serves_gets_its_requests(lora):
    """Loaded on engine a alone (as through another frontend, or before b restarted): the
    frontend learns of it when a request names it (its lists are read again on such a miss, at
    most once per REFRESH_MIN_S), and sends its requests to a only; an unload through the
    frontend is done though b never had it."""
    only_a = lora.engines[0]
    lora.engine_stubs[0].LoadLoRAAdapter(common_pb2.LoadLoRAAdapterRequest(
        lora_name="solo", lora_path=str(lora.adapters["poet"])), timeout=120)
    time.sleep(REFRESH_MIN_S + 0.1)  # the frontend's last reading of the lists may be that recent
    for i in range(3):
        lora.stub.Complete(grpc_request("solo", f"solo-{i}", max_tokens=2), timeout=120)
    served = {e["request_id"]: e["engine"] for e in json_lines(lora.frontend.log_path)
              if e.get("msg") == "request submitted" and e.get("lora_name") == "solo"}
    assert sorted(served) == ["solo-0", "solo-1", "solo-2"] and set(served.values()) == {only_a.addr}
    assert lora.http.post("/v1/unload_lora_adapter", json={"lora_name": "solo"}).status_code == 200
    assert lora.engine_adapters() == [["chef", "pirate"]] * 2


@pytest.mark.integration
def test_without_the_flag_the_update_routes_do_not_exist(lora):
    for path, body in (("/v1/load_lora_adapter", {"lora_name": "poet", "lora_path": str(lora.adapters["poet"])}),
                       ("/v1/unload_lora_adapter", {"lora_name": "chef"})):
        assert _error(lora.plain_http.post(path, json=body), 404)["code"] == "not_found"
    with pytest.raises(grpc.RpcError) as info:
        lora.plain_stub.LoadLoRAAdapter(common_pb2.LoadLoRAAdapterRequest(
            lora_name="poet", lora_path=str(lora.adapters["poet"])), timeout=30)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert info.value.details() == ("runtime LoRA updating is off: start the frontend with "
                                    "--allow-runtime-lora-updating")
    assert lora.engine_adapters() == [["chef", "pirate"]] * 2
    # serving the adapters the engines have needs no flag
    reply = lora.plain_http.post("/v1/chat/completions", json={
        "model": "chef", "messages": [{"role": "user", "content": QUESTION}], "temperature": 0,
        "max_tokens": MAX_TOKENS, "ignore_eos": True})
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == lora.chat("chef")


# -- migration (kills an engine: last) ---------------------------------------------------------------
@pytest.mark.integration
def test_a_request_keeps_its_adapter_when_its_replica_is_lost(lora):
    """An adapter request whose engine dies mid-answer goes on on the other replica, with its
    adapter: the text is the one it gives alone."""
    long_tokens = 96
    whole = lora.stub.Complete(grpc_request("pirate", "whole", long_tokens), timeout=300).choices[0].text
    stream = lora.stub.Generate(grpc_request("pirate", "moving", long_tokens), timeout=300)
    texts = [next(stream).text]
    where = next(e["engine"] for e in json_lines(lora.frontend.log_path)
                 if e.get("msg") == "request submitted" and e.get("request_id") == "moving")
    next(e for e in lora.engines if e.addr == where).kill()
    texts += [r.text for r in stream]
    assert "".join(texts) == whole
    moved = [e for e in json_lines(lora.frontend.log_path)
             if e.get("msg") == "request migrated" and e.get("request_id") == "moving"]
    assert moved and moved[0]["from"] == where, lora.frontend.log_tail()


# -- tessera serve -------------------------------------------------------------------------------------
@pytest.mark.unit
def test_serve_routes_the_lora_flags_to_the_services_that_take_them():
    parser = serve.build_parser()
    args, extra = parser.parse_known_args(["--lora-modules", "a=/p", "b=/q", "--max-loras", "2",
                                           "--allow-runtime-lora-updating", "true", "--max-lora-rank", "32"])
    routed = serve.route_flags(parser, extra)
    assert routed["engine"] == ["--lora-modules", "a=/p", "b=/q", "--max-loras", "2", "--max-lora-rank", "32"]
    assert routed["frontend"] == ["--allow-runtime-lora-updating", "true"] and routed["tokenizer"] == []

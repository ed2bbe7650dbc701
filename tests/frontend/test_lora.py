"""The frontend's LoRA logic in-process: the served list and its load / unload across replicas
(`lora`), a request for an adapter routed to replicas serving it (`engine_client`), the HTTP
side (`lora_api`'s routes, `openai_api`'s model names and cards) and the gRPC side (`grpc_api`).

`FakeLoRAEngine` stands in for an EngineReplica's LoRA calls: an engine's adapter table with
the engine's answers (FAILED_PRECONDITION without LoRA, INVALID_ARGUMENT for a path holding
"broken", ALREADY_EXISTS, NOT_FOUND). The real engine's answers are tests/stack/test_lora_stack.py's.
"""
from __future__ import annotations

import asyncio

import grpc
import pytest
from fastapi.testclient import TestClient

from helpers.fakes import FakeTokenizerClient, run_async
from tessera.v1 import common_pb2, engine_pb2, frontend_pb2
from tessera_frontend.admission import AdmissionController
from tessera_frontend.async_llm import AsyncLLM
from tessera_frontend.engine_client import EngineCoreClient, EngineReplica
from tessera_frontend.grpc_api import FrontendServicer
from tessera_frontend.lora import RUNTIME_UPDATES_OFF, LoRAError, LoRARegistry, served_adapters
from tessera_frontend.openai_api import create_app
from tessera_frontend.output_processor import SampleOutput
from tessera_frontend.validation import Limits

pytestmark = pytest.mark.unit

Code = grpc.StatusCode


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


def adapter(name: str, path: str = "", rank: int = 8) -> common_pb2.LoRAAdapter:
    return common_pb2.LoRAAdapter(name=name, path=path or f"/adapters/{name}", rank=rank, target_modules=["q_proj"])


class FakeLoRAEngine:
    """An engine replica's LoRA side (EngineReplica's refresh_lora / load_lora / unload_lora)."""

    def __init__(self, addr: str, *names: str, enabled: bool = True, max_loras: int = 2, max_lora_rank: int = 16):
        self.addr = addr
        self.retired = False
        self.connected = True
        self.enabled, self.max_loras, self.max_lora_rank = enabled, max_loras, max_lora_rank
        self.table = {name: adapter(name) for name in names}
        self.lora: common_pb2.LoRAAdapters | None = None  # as EngineReplica: None until it listed
        self.list_calls = 0

    def listing(self) -> common_pb2.LoRAAdapters:
        return common_pb2.LoRAAdapters(adapters=list(self.table.values()), enabled=self.enabled,
                                       max_loras=self.max_loras, max_lora_rank=self.max_lora_rank)

    async def refresh_lora(self) -> common_pb2.LoRAAdapters:
        self.list_calls += 1
        await asyncio.sleep(0)
        self.lora = self.listing()
        return self.lora

    async def load_lora(self, name: str, path: str) -> common_pb2.LoRAAdapter:
        if not self.enabled:
            raise rpc_error(Code.FAILED_PRECONDITION, "LoRA is off: start the engine with --enable-lora")
        if "broken" in path:
            raise rpc_error(Code.INVALID_ARGUMENT, f"{path}/adapter_config.json: r 999 is over --max-lora-rank 16")
        if name in self.table:
            raise rpc_error(Code.ALREADY_EXISTS, f"the LoRA adapter {name!r} is loaded already")
        self.table[name] = adapter(name, path)
        return self.table[name]

    async def unload_lora(self, name: str) -> common_pb2.LoRAAdapter:
        if name not in self.table:
            raise rpc_error(Code.NOT_FOUND, f"no LoRA adapter {name!r} is loaded")
        return self.table.pop(name)


class FakeEngines:
    """The replica set as LoRARegistry and AsyncLLM read it (EngineCoreClient's `replicas`, limits)."""

    def __init__(self, *replicas: FakeLoRAEngine) -> None:
        self.replicas = list(replicas)
        self.ready = True
        self.max_model_len = 2048
        self.kv_cache_tokens = None

    async def listed(self) -> "FakeEngines":
        """Each replica's list read, as before its session opens."""
        for replica in self.replicas:
            await replica.refresh_lora()
        return self


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# -- lora: the served list ---------------------------------------------------------------------------
def test_the_served_list_is_the_replicas_lists_as_one():
    a = common_pb2.LoRAAdapters(adapters=[adapter("x"), adapter("y")], enabled=True, max_loras=4, max_lora_rank=64)
    b = common_pb2.LoRAAdapters(adapters=[adapter("y", "/elsewhere"), adapter("z")], enabled=True, max_loras=2,
                                max_lora_rank=128)
    off = common_pb2.LoRAAdapters()  # an engine without --enable-lora (or without the RPC)
    merged = served_adapters([off, a, b])
    assert [(x.name, x.path) for x in merged.adapters] == [("x", "/adapters/x"), ("y", "/adapters/y"),
                                                            ("z", "/adapters/z")]
    assert merged.enabled and (merged.max_loras, merged.max_lora_rank) == (2, 64)  # what every replica takes
    assert served_adapters([off]) == common_pb2.LoRAAdapters()


@run_async
async def test_a_name_not_listed_asks_the_replicas_again_at_most_once_a_second():
    a, b = FakeLoRAEngine("a", "x"), FakeLoRAEngine("b", "x")
    clock = Clock()
    registry = LoRARegistry(FakeEngines(a, b), clock=clock)
    assert not registry.known  # nothing listed yet: no name is known to be unknown
    await registry.engine.listed()
    assert registry.known and [x.name for x in registry.served().adapters] == ["x"]
    a.table["y"] = b.table["y"] = adapter("y")  # loaded through another frontend
    assert registry.get("y") is None
    assert (await registry.find("y")).name == "y" and (a.list_calls, b.list_calls) == (2, 2)
    # misses in a burst share one round, and then none for REFRESH_MIN_S
    clock.now += 5
    found = await asyncio.gather(*(registry.find("nope") for _ in range(5)))
    assert found == [None] * 5 and (a.list_calls, b.list_calls) == (3, 3)
    assert await registry.find("nope") is None and a.list_calls == 3
    clock.now += 1
    del a.table["y"], b.table["y"]
    assert [x.name for x in (await registry.list()).adapters] == ["x"] and a.list_calls == 4


@run_async
async def test_a_replica_not_connected_does_not_count():
    a, b = FakeLoRAEngine("a", "x"), FakeLoRAEngine("b", "y")
    registry = LoRARegistry(await FakeEngines(a, b).listed())
    b.connected = False
    assert [x.name for x in registry.served().adapters] == ["x"]


# -- lora: load and unload on every replica ------------------------------------------------------------
@run_async
async def test_load_and_unload_reach_every_replica_and_refresh_their_lists():
    a, b = FakeLoRAEngine("a"), FakeLoRAEngine("b")
    registry = LoRARegistry(await FakeEngines(a, b).listed(), allow_updates=True)
    loaded = await registry.load("sql", "/adapters/sql")
    assert loaded.name == "sql" and set(a.table) == set(b.table) == {"sql"}
    assert registry.get("sql") is not None and all(r.lora.adapters for r in (a, b))  # no refresh needed
    assert (await registry.unload("sql")).name == "sql"
    assert a.table == b.table == {} and registry.get("sql") is None


@run_async
async def test_the_first_failure_is_answered_with_the_engine_s_status():
    one = LoRARegistry(await FakeEngines(FakeLoRAEngine("a", "x")).listed(), allow_updates=True)
    with pytest.raises(LoRAError) as info:
        await one.load("y", "/adapters/broken")
    assert info.value.code == Code.INVALID_ARGUMENT  # one replica: its message as it is
    assert info.value.message == "/adapters/broken/adapter_config.json: r 999 is over --max-lora-rank 16"
    with pytest.raises(LoRAError) as info:
        await one.load("x", "/adapters/x2")
    assert info.value.code == Code.ALREADY_EXISTS and "'x'" in info.value.message
    with pytest.raises(LoRAError) as info:
        await one.unload("nope")
    assert info.value.code == Code.NOT_FOUND and "'nope'" in info.value.message

    a, b = FakeLoRAEngine("a"), FakeLoRAEngine("b", "x")
    two = LoRARegistry(await FakeEngines(a, b).listed(), allow_updates=True)
    with pytest.raises(LoRAError) as info:
        await two.load("x", "/adapters/x")
    assert info.value.code == Code.ALREADY_EXISTS
    assert info.value.message.startswith("engine b: the LoRA adapter 'x' is loaded already")
    assert info.value.message.endswith("(1 of 2 engine replicas did load it)")
    assert "x" in a.table  # not rolled back: requests for it go where it is

    off = LoRARegistry(await FakeEngines(FakeLoRAEngine("a", enabled=False)).listed(), allow_updates=True)
    with pytest.raises(LoRAError) as info:
        await off.load("x", "/adapters/x")
    assert info.value.code == Code.FAILED_PRECONDITION and "--enable-lora" in info.value.message


@run_async
async def test_unload_is_done_when_no_replica_has_it_any_more():
    a, b = FakeLoRAEngine("a", "x"), FakeLoRAEngine("b")  # b restarted since x was loaded
    registry = LoRARegistry(await FakeEngines(a, b).listed(), allow_updates=True)
    assert (await registry.unload("x")).name == "x" and a.table == {}
    with pytest.raises(LoRAError) as info:  # on no replica at all: NOT_FOUND naming it
        await registry.unload("x")
    assert info.value.code == Code.NOT_FOUND and info.value.message.startswith("engine a: no LoRA adapter 'x'")


@run_async
async def test_updates_need_the_flag_both_fields_and_a_replica():
    engines = await FakeEngines(FakeLoRAEngine("a")).listed()
    with pytest.raises(LoRAError) as info:
        await LoRARegistry(engines).load("x", "/adapters/x")
    assert info.value.code == Code.FAILED_PRECONDITION and info.value.message == RUNTIME_UPDATES_OFF
    with pytest.raises(LoRAError) as info:
        await LoRARegistry(engines).unload("x")
    assert info.value.code == Code.FAILED_PRECONDITION
    registry = LoRARegistry(engines, allow_updates=True)
    with pytest.raises(LoRAError) as info:
        await registry.load("", "")
    assert info.value.code == Code.INVALID_ARGUMENT and info.value.message == "lora_name and lora_path are required"
    with pytest.raises(LoRAError) as info:
        await registry.load("x", "")
    assert info.value.message == "lora_path is required" and info.value.param == "lora_path"
    engines.replicas[0].connected = False
    with pytest.raises(LoRAError) as info:
        await registry.load("x", "/adapters/x")
    assert info.value.code == Code.UNAVAILABLE


# -- engine_client: where a request for an adapter goes --------------------------------------------------
@run_async
async def test_a_request_for_an_adapter_goes_to_a_replica_that_serves_it():
    client = EngineCoreClient(["127.0.0.1:1", "127.0.0.1:2"])
    with_x, without = EngineReplica("127.0.0.1:1"), EngineReplica("127.0.0.1:2")
    try:
        for replica, names in ((with_x, ["x"]), (without, [])):
            replica._outbox, replica.healthy = asyncio.Queue(), True  # a session open
            replica.lora = common_pb2.LoRAAdapters(adapters=[adapter(n) for n in names], enabled=True)
        client._replicas = {r.addr: r for r in (with_x, without)}
        for i in range(4):
            request = engine_pb2.EngineRequest(request_id=f"r{i}", prompt_token_ids=[1, 2], lora_name="x")
            assert client.submit(request, 1) == with_x.addr
        base = {client.submit(engine_pb2.EngineRequest(request_id=f"b{i}", prompt_token_ids=[1, 2]), 1)
                for i in range(8)}
        assert base == {with_x.addr, without.addr}
        # served by none: sent anyway, and that engine's NOT_FOUND names it
        assert client.submit(engine_pb2.EngineRequest(request_id="u", lora_name="nope"), 1) in base
        with_x.lora = None  # not listed yet: it may serve any
        assert with_x.serves("nope") and not without.serves("nope") and without.serves("")
    finally:
        for replica in (with_x, without):
            await replica.close()


# -- HTTP: models, adapters as models, the load / unload routes ------------------------------------------
class Generated:
    """Stands in for AsyncLLM.generate: records the adapter each request ran with, answers "ok"."""

    def __init__(self) -> None:
        self.lora_names: list[str] = []

    async def __call__(self, request_id, prompt, params, priority=0, default_max_tokens=None, lora_name=""):
        self.lora_names.append(lora_name)
        yield SampleOutput(request_id=request_id, text="ok", token_ids=[1], finish_reason=common_pb2.FINISH_REASON_STOP,
                           usage=common_pb2.Usage(prompt_tokens=2, completion_tokens=1), num_prompt_tokens=2)


def http_client(engines: FakeEngines, allow_updates: bool) -> tuple[TestClient, Generated]:
    llm = AsyncLLM(FakeTokenizerClient(), engines)
    llm.generate = generated = Generated()
    app = create_app(llm, Limits(), AdmissionController(8), None, LoRARegistry(engines, allow_updates))
    return TestClient(app), generated


def test_adapters_are_models_and_requests_naming_one_run_with_it():
    engines = asyncio.run(FakeEngines(FakeLoRAEngine("a", "sql", "chat")).listed())
    client, generated = http_client(engines, allow_updates=False)
    with client:
        data = client.get("/v1/models").json()["data"]
        assert [m["id"] for m in data] == ["fake-model", "sql", "chat"]
        assert "parent" not in data[0] and data[0]["max_model_len"] == 2048
        assert {k: v for k, v in data[1].items() if k != "created"} == {
            "id": "sql", "object": "model", "owned_by": "tessera", "root": "/adapters/sql", "parent": "fake-model",
            "max_model_len": 2048}
        assert client.get("/v1/models/chat").json()["parent"] == "fake-model"
        assert client.get("/v1/models/fake-model").json()["id"] == "fake-model"

        messages = [{"role": "user", "content": "Hello"}]
        for model in ("sql", "fake-model", None):
            body = {"messages": messages, **({"model": model} if model else {})}
            reply = client.post("/v1/chat/completions", json=body)
            assert reply.status_code == 200 and reply.json()["model"] == (model or "fake-model")
        reply = client.post("/v1/completions", json={"model": "chat", "prompt": "Hello"})
        assert reply.status_code == 200 and reply.json()["model"] == "chat"
        assert generated.lora_names == ["sql", "", "", "chat"]

        reply = client.post("/v1/chat/completions", json={"model": "gpt-9", "messages": messages})
        error = reply.json()["error"]
        assert reply.status_code == 404 and error["code"] == "model_not_found" and error["param"] == "model"
        assert error["message"] == ("The model `gpt-9` does not exist (this server serves `fake-model` "
                                    "and the LoRA adapters `sql`, `chat`).")
        assert client.get("/v1/models/gpt-9").status_code == 404
        # without --allow-runtime-lora-updating the routes do not exist
        reply = client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/adapters/x"})
        assert reply.status_code == 404 and reply.json()["error"]["code"] == "not_found"
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}).status_code == 404


def test_the_load_and_unload_routes_answer_as_vllm():
    a, b = FakeLoRAEngine("a"), FakeLoRAEngine("b")
    engines = asyncio.run(FakeEngines(a, b).listed())
    client, generated = http_client(engines, allow_updates=True)
    with client:
        reply = client.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": "/adapters/sql"})
        assert reply.status_code == 200 and reply.text == "Success: LoRA adapter 'sql' added successfully."
        assert "sql" in a.table and "sql" in b.table
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["fake-model", "sql"]
        reply = client.post("/v1/completions", json={"model": "sql", "prompt": "Hello"})
        assert reply.status_code == 200 and generated.lora_names == ["sql"]

        def error(path: str, body: dict, status: int) -> dict:
            reply = client.post(path, json=body)
            assert reply.status_code == status, reply.text
            return reply.json()["error"]

        assert "'sql' is loaded already" in error("/v1/load_lora_adapter",
                                                  {"lora_name": "sql", "lora_path": "/adapters/sql"}, 400)["message"]
        assert "r 999" in error("/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": "/broken"}, 400)["message"]
        missing = error("/v1/load_lora_adapter", {"lora_name": "x"}, 400)
        assert missing["message"] == "lora_path is required" and missing["param"] == "lora_path"
        assert error("/v1/load_lora_adapter", {}, 400)["message"] == "lora_name and lora_path are required"
        assert error("/v1/unload_lora_adapter", {}, 400)["param"] == "lora_name"

        reply = client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
        assert reply.status_code == 200 and reply.text == "Success: LoRA adapter 'sql' removed successfully."
        assert "'sql'" in error("/v1/unload_lora_adapter", {"lora_name": "sql"}, 404)["message"]
        assert client.post("/v1/completions", json={"model": "sql", "prompt": "Hello"}).status_code == 404


# -- gRPC: GenerateRequest.lora_name and the LoRA calls ---------------------------------------------------
class Aborted(Exception):
    pass


class FakeContext:
    """The grpc.aio.ServicerContext calls the servicer makes: abort raises, as grpc's does."""

    def __init__(self) -> None:
        self.status: tuple[grpc.StatusCode, str] | None = None

    def invocation_metadata(self):
        return ()

    def code(self):
        return self.status[0] if self.status else None

    async def abort(self, code: grpc.StatusCode, details: str, trailing_metadata=()):
        self.status = (code, details)
        self.trailing_metadata = tuple(trailing_metadata)
        raise Aborted(details)


@run_async
async def test_grpc_refuses_an_unknown_adapter_before_admission_and_gates_updates():
    engines = await FakeEngines(FakeLoRAEngine("a", "sql")).listed()
    full = AdmissionController(1)
    full.admit()  # at capacity: only a refusal before admission answers other than RESOURCE_EXHAUSTED
    servicer = FrontendServicer(AsyncLLM(FakeTokenizerClient(), engines), Limits(), full, LoRARegistry(engines))
    context = FakeContext()
    with pytest.raises(Aborted):
        await servicer.Complete(frontend_pb2.GenerateRequest(text="Hello", lora_name="nope"), context)
    assert context.status == (Code.NOT_FOUND, "lora_name: the LoRA adapter 'nope' is not served (served: sql)")
    context = FakeContext()
    with pytest.raises(Aborted):
        await servicer.Complete(frontend_pb2.GenerateRequest(text="Hello", lora_name="sql"), context)
    assert context.status[0] == Code.RESOURCE_EXHAUSTED  # a served one passes on to admission
    assert context.trailing_metadata == (("retry-after", "1"),)  # the client's hint, as HTTP's Retry-After

    listed = await servicer.ListLoRAAdapters(common_pb2.ListLoRAAdaptersRequest(), FakeContext())
    assert [x.name for x in listed.adapters] == ["sql"] and listed.enabled and listed.max_lora_rank == 16
    for call, request in ((servicer.LoadLoRAAdapter, common_pb2.LoadLoRAAdapterRequest(lora_name="x", lora_path="/x")),
                          (servicer.UnloadLoRAAdapter, common_pb2.UnloadLoRAAdapterRequest(lora_name="sql"))):
        context = FakeContext()
        with pytest.raises(Aborted):
            await call(request, context)
        assert context.status == (Code.FAILED_PRECONDITION, RUNTIME_UPDATES_OFF)
    assert "sql" in engines.replicas[0].table

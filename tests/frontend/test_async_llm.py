"""AsyncLLM in-process: a fake engine client and the fake tokenizer client of
test_output_processor, wired through the real OutputProcessor.

The fake engine stands in for EngineCoreClient: it runs each submitted request's samples
one token per step (sample i reads SCRIPT, round and round, from position 4 * i) until
max_tokens, hands every step to AsyncLLM's step handler, and records submissions and
aborts, so the tests see what AsyncLLM asked of the engine (the aborts the output
processor returned included).
"""
from __future__ import annotations

import asyncio

import grpc
import pytest

from tessera.v1 import common_pb2, engine_pb2, tokenizer_pb2
from tessera_frontend import async_llm as async_llm_module
from tessera_frontend.async_llm import AsyncLLM, GenerateError
from tessera_frontend.engine_client import NoReplicaError
from tessera_frontend.output_processor import SampleOutput
from helpers.fakes import EOS, WORDS, FakeTokenizerClient, ids, run_async

pytestmark = pytest.mark.unit

RUNNING = common_pb2.FINISH_REASON_UNSPECIFIED
STOP = common_pb2.FINISH_REASON_STOP
LENGTH = common_pb2.FINISH_REASON_LENGTH
ABORT = common_pb2.FINISH_REASON_ABORT

SCRIPT = ids("Hello", ",", " world", "!", " the", " end", " and", " more")


class FakeEngine:
    """Stands in for EngineCoreClient (submit / abort / abort_samples / start / close and the limits)."""

    def __init__(self, max_model_len: int | None = None, kv_cache_tokens: int | None = None) -> None:
        self.ready = True
        self.timeout_s = 1.0  # how long a migrating request waits for a replica
        self.max_model_len = max_model_len
        self.kv_cache_tokens = kv_cache_tokens
        self.refuse = False  # submit raises NoReplicaError
        self.replicas = ["fake-engine:1"]  # addresses submit picks from (the first not excluded)
        self.paused = False  # no steps run while set (requests wait, as in a busy engine's queue)
        self.submitted: list[tuple[engine_pb2.EngineRequest, int, bool]] = []
        self.aborted: list[str] = []
        self.aborted_samples: list[engine_pb2.SampleRef] = []
        self._running: dict[str, dict[int, int]] = {}   # request id -> sample index -> tokens made
        self._max_tokens: dict[str, int] = {}
        self._to_abort: set[tuple[str, int]] = set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self, on_step, on_lost, on_handoff=None) -> None:
        self.on_step, self.on_lost, self.on_handoff = on_step, on_lost, on_handoff
        self._task = asyncio.create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def submit(self, request: engine_pb2.EngineRequest, num_samples: int, more_coming: bool = False,
               exclude=()) -> str:
        left = [r for r in self.replicas if r not in exclude]
        if self.refuse or not left:
            raise NoReplicaError("no engine replica is connected")
        self.submitted.append((request, num_samples, more_coming))
        if request.resumed:  # a migrated request: each sample goes on after its tokens
            self._running[request.request_id] = {r.index: len(r.output_token_ids) for r in request.resumed}
        else:
            self._running[request.request_id] = {i: 0 for i in range(num_samples)}
        self._max_tokens[request.request_id] = request.sampling_params.max_tokens
        self._wake.set()
        return left[0]

    def can_retry_elsewhere(self, exclude) -> bool:
        return any(r not in exclude for r in self.replicas)

    def resume(self) -> None:
        self.paused = False
        self._wake.set()

    def abort(self, request_ids) -> None:
        self.aborted.extend(request_ids)
        for request_id in request_ids:
            self._to_abort.update((request_id, i) for i in self._running.get(request_id, ()))

    def abort_samples(self, samples) -> None:
        self.aborted_samples.extend(samples)
        self._to_abort.update((s.request_id, s.index) for s in samples)

    def lose(self, request_id: str, reason: str) -> None:
        """The replica's stream broke: the request is gone from the engine."""
        self._running.pop(request_id, None)
        self.on_lost([request_id], reason)

    async def _run(self) -> None:
        while True:
            if not self._running or self.paused:
                self._wake.clear()
                await self._wake.wait()
                continue
            step = engine_pb2.EngineStepOutputs()
            for request_id, samples in list(self._running.items()):
                for index, made in list(samples.items()):
                    out = step.outputs.add(request_id=request_id, index=index, num_prompt_tokens=3)
                    if (request_id, index) in self._to_abort:
                        out.finish_reason = ABORT
                    else:
                        out.new_token_ids.append(SCRIPT[(4 * index + made) % len(SCRIPT)])
                        samples[index] = made = made + 1
                        if made == self._max_tokens[request_id]:
                            out.finish_reason = LENGTH
                    if out.finish_reason != RUNNING:
                        del samples[index]
                if not samples:
                    del self._running[request_id]
            await self.on_step(step)
            await asyncio.sleep(0)


class GatedTokenizer(FakeTokenizerClient):
    """Tokenizing a prompt that contains "slow" waits until `gate` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()

    async def tokenize(self, request, request_id):
        if "slow" in request.text:
            await self.gate.wait()
        return await super().tokenize(request, request_id)


def started(stream_interval: int = 1, engine: FakeEngine | None = None,
            tokenizer: FakeTokenizerClient | None = None) -> AsyncLLM:
    llm = AsyncLLM(tokenizer or FakeTokenizerClient(), engine or FakeEngine(), stream_interval)
    llm.start()
    return llm


async def collect(llm: AsyncLLM, prompt="a b c", request_id: str = "r1", **params) -> list[SampleOutput]:
    return [out async for out in llm.generate(request_id, prompt, common_pb2.SamplingParams(**params))]


def text_of(outs: list[SampleOutput], index: int = 0) -> str:
    return "".join(o.text for o in outs if o.index == index)


@run_async
async def test_generate_streams_each_step_and_reports_usage_last():
    llm = started()
    try:
        outs = await collect(llm, max_tokens=4)
        assert [(o.text, o.finish_reason) for o in outs] == [
            ("Hello", RUNNING), (",", RUNNING), (" world", RUNNING), ("!", LENGTH)]
        assert all(o.request_id == "r1" and o.num_prompt_tokens == 3 for o in outs)
        assert [o.usage for o in outs[:-1]] == [None] * 3
        assert outs[-1].usage == common_pb2.Usage(prompt_tokens=3, completion_tokens=4)
        ((request, n, _),) = llm.engine.submitted
        assert request.request_id.startswith("r1-") and n == 1
        assert list(request.eos_token_ids) == [EOS] and request.sampling_params.n == 1
        assert llm.engine.aborted == [] and len(llm.processor) == 0  # ran to the end: nothing to abort
    finally:
        await llm.close()


@run_async
async def test_max_tokens_defaults():
    llm = started()
    try:
        await collect(llm, "a b c", max_tokens=2)
        await collect(llm, "a b c")
        assert llm.engine.submitted[-1][0].sampling_params.max_tokens == 16  # vLLM's default
        outs = [o async for o in llm.generate("chat", "a b c", common_pb2.SamplingParams(),
                                              default_max_tokens=None)]
        # OpenAI chat's default: up to the model's length (the tokenizer's 64 here) minus the prompt
        assert llm.engine.submitted[-1][0].sampling_params.max_tokens == 64 - 3
        assert outs[-1].usage.completion_tokens == 61
    finally:
        await llm.close()


@run_async
async def test_stop_string_ends_the_request_and_aborts_it_in_the_engine():
    llm = started()
    try:
        outs = await collect(llm, max_tokens=8, stop=[" world"])
        assert text_of(outs) == "Hello,"
        assert (outs[-1].finish_reason, outs[-1].stop_reason) == (STOP, " world")
        assert outs[-1].usage.completion_tokens == 3  # the tokens up to and including the stop string's
        engine_id = llm.engine.submitted[0][0].request_id
        assert llm.engine.aborted == [engine_id]  # the processor's reqs_to_abort, done by AsyncLLM
    finally:
        await llm.close()


@run_async
async def test_one_sample_stopped_is_aborted_alone():
    llm = started()
    try:
        outs = await collect(llm, max_tokens=4, n=2, stop=[" world"])
        assert text_of(outs, 0) == "Hello," and text_of(outs, 1) == " the end and more"
        finals = {o.index: o for o in outs if o.finished}
        assert finals[0].finish_reason == STOP and finals[1].finish_reason == LENGTH
        assert outs[-1].usage.completion_tokens == 3 + 4
        engine_id = llm.engine.submitted[0][0].request_id
        assert llm.engine.aborted_samples == [engine_pb2.SampleRef(request_id=engine_id, index=0)]
        assert llm.engine.aborted == []
    finally:
        await llm.close()


@run_async
async def test_closing_the_generator_aborts_the_request():
    llm = started()
    try:
        outputs = llm.generate("r1", "a b c", common_pb2.SamplingParams(max_tokens=20))
        first = await outputs.__anext__()
        assert first.text == "Hello"
        await outputs.aclose()
        engine_id = llm.engine.submitted[0][0].request_id
        assert llm.engine.aborted == [engine_id]
        assert llm.tokenizer.stream.cancelled == [f"{engine_id}#0"]
        assert engine_id not in llm.processor
    finally:
        await llm.close()


@run_async
async def test_stream_interval_groups_tokens_after_the_first():
    llm = started(stream_interval=3)
    try:
        grouped = await collect(llm, max_tokens=8)
        assert [len(o.token_ids) for o in grouped] == [1, 3, 3, 1]
        assert text_of(grouped) == "Hello, world! the end and more"
        assert grouped[-1].finish_reason == LENGTH and grouped[-1].usage.completion_tokens == 8
        assert [o.finished for o in grouped] == [False, False, False, True]
    finally:
        await llm.close()
    with pytest.raises(ValueError):
        AsyncLLM(FakeTokenizerClient(), FakeEngine(), stream_interval=0)


@run_async
async def test_prompt_kinds():
    llm = started()
    try:
        chat = tokenizer_pb2.ChatMessages(messages=[tokenizer_pb2.ChatMessage(role="user", content="hi there")])
        outs = await collect(llm, chat, max_tokens=1)
        assert outs[-1].usage.prompt_tokens == 3  # role + two words
        request = llm.tokenizer.tokenized[-1]
        assert request.HasField("chat") and request.add_generation_prompt
        await collect(llm, [1, 2, 3, 4], max_tokens=1)
        assert list(llm.engine.submitted[-1][0].prompt_token_ids) == [1, 2, 3, 4]
        assert len(llm.tokenizer.tokenized) == 1  # token ids are not tokenized
    finally:
        await llm.close()


@pytest.mark.parametrize("prompt,params,field", [
    ([1, len(WORDS)], dict(max_tokens=1), "token_ids"),
    ("", dict(max_tokens=1), "prompt"),
    ("a b c", dict(max_tokens=62), "max_tokens"),               # 3 + 62 > the model's 64
    ("a b c", dict(min_tokens=20), "min_tokens"),               # the default max_tokens is 16
    ("a b c", dict(stop_token_ids=[len(WORDS)]), "stop_token_ids"),
    ("refuse this", dict(), "tokenizer"),
])
@run_async
async def test_requests_the_model_cannot_serve_are_invalid(prompt, params, field):
    llm = started()
    try:
        with pytest.raises(GenerateError) as info:
            await collect(llm, prompt, **params)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.message.startswith(f"{field}:"), info.value.message
        assert llm.engine.submitted == []
    finally:
        await llm.close()


@run_async
async def test_the_kv_cache_and_the_engines_max_model_len_bound_a_request():
    llm = started(engine=FakeEngine(max_model_len=10, kv_cache_tokens=8))
    try:
        assert llm.max_model_len == 10  # the engines' limit over the tokenizer's
        with pytest.raises(GenerateError, match="KV cache"):
            await collect(llm, max_tokens=6)
        with pytest.raises(GenerateError, match="max length"):
            await collect(llm, max_tokens=8)
        assert len(await collect(llm, max_tokens=5)) == 5
    finally:
        await llm.close()


@run_async
async def test_unavailable_backends():
    engine = FakeEngine()
    llm = started(engine=engine)
    try:
        engine.refuse = True
        with pytest.raises(GenerateError) as info:
            await collect(llm, max_tokens=2)
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        assert len(llm.processor) == 0  # its state is released
        engine.refuse, engine.ready = False, False
        async_llm_module.READY_WAIT_S, saved = 0.1, async_llm_module.READY_WAIT_S
        try:
            with pytest.raises(GenerateError, match="not ready") as info:
                await collect(llm, max_tokens=2)
        finally:
            async_llm_module.READY_WAIT_S = saved
        assert info.value.code == grpc.StatusCode.UNAVAILABLE and not llm.ready
    finally:
        await llm.close()


@run_async
async def test_a_lost_engine_s_request_migrates_and_its_text_goes_on_exactly():
    engine = FakeEngine()
    llm = started(engine=engine)
    try:
        whole = await collect(llm, request_id="r0", max_tokens=12, n=2)
        outputs = llm.generate("r1", "a b c", common_pb2.SamplingParams(max_tokens=12, n=2, prompt_logprobs=1))
        got = [await outputs.__anext__(), await outputs.__anext__()]
        engine_id = engine.submitted[-1][0].request_id
        engine.lose(engine_id, "engine fake-engine:1 went away")
        got += [out async for out in outputs]
        for index in (0, 1):
            assert text_of(got, index) == text_of(whole, index)
        assert got[-1].usage.completion_tokens == 24  # each output token counted once
        moved = engine.submitted[-1][0]
        # a new engine id (the replica left may still hold the old one), the same client request
        assert moved.request_id != engine_id and moved.request_id.startswith("r1-")
        resumed = {r.index: list(r.output_token_ids) for r in moved.resumed}
        assert set(resumed) == {0, 1} and all(resumed.values())
        assert not moved.sampling_params.HasField("prompt_logprobs")  # sent with the first output already
        assert moved.sampling_params.seed == engine.submitted[-2][0].sampling_params.seed  # set at admission
        assert engine.aborted == []  # the engine had dropped it already
        assert len(llm.processor) == 0
    finally:
        await llm.close()


@run_async
async def test_the_lora_adapter_goes_with_the_request_and_with_its_migration():
    engine = FakeEngine()
    llm = started(engine=engine)
    try:
        await collect(llm, max_tokens=2)
        assert engine.submitted[-1][0].lora_name == ""  # the base model
        outputs = llm.generate("r1", "a b c", common_pb2.SamplingParams(max_tokens=6), lora_name="sql")
        first = await outputs.__anext__()
        assert engine.submitted[-1][0].lora_name == "sql"
        engine.lose(engine.submitted[-1][0].request_id, "engine fake-engine:1 went away")
        rest = [out async for out in outputs]
        moved = engine.submitted[-1][0]
        assert moved.resumed and moved.lora_name == "sql"  # the rebuilt EngineRequest keeps its adapter
        assert len([first, *rest]) == 6
    finally:
        await llm.close()


@run_async
async def test_a_request_lost_before_its_first_token_migrates_too():
    engine = FakeEngine()
    engine.paused = True
    llm = started(engine=engine)
    try:
        task = asyncio.ensure_future(collect(llm, max_tokens=4))
        while not engine.submitted:
            await asyncio.sleep(0)
        first = engine.submitted[0][0].request_id
        engine.lose(first, "engine engine-a:1 went away")
        while len(engine.submitted) < 2:
            await asyncio.sleep(0)
        engine.resume()
        outs = await task
        assert text_of(outs) == "Hello, world!" and outs[-1].usage.completion_tokens == 4
        moved = engine.submitted[1][0]
        assert moved.request_id != first and [(r.index, list(r.output_token_ids)) for r in moved.resumed] == [(0, [])]
    finally:
        await llm.close()


@run_async
async def test_migration_is_bounded_and_waits_for_a_replica_up_to_the_engine_timeout():
    engine = FakeEngine()
    llm = started(engine=engine)
    try:
        # lost more often than MAX_MIGRATIONS: UNAVAILABLE, saying so
        outputs = llm.generate("r1", "a b c", common_pb2.SamplingParams(max_tokens=50))
        await outputs.__anext__()
        with pytest.raises(GenerateError) as info:
            for _ in range(async_llm_module.MAX_MIGRATIONS + 1):
                engine.lose(engine.submitted[-1][0].request_id, "engine fake-engine:1 went away")
                await outputs.__anext__()
        assert info.value.code == grpc.StatusCode.UNAVAILABLE and "moved replicas" in info.value.message
        assert len(engine.submitted) == 1 + async_llm_module.MAX_MIGRATIONS

        # no replica to take it: it waits, and continues once one is back ...
        outputs = llm.generate("r2", "a b c", common_pb2.SamplingParams(max_tokens=6))
        got = [await outputs.__anext__()]
        engine.refuse = True
        engine.lose(engine.submitted[-1][0].request_id, "engine fake-engine:1 went away")
        await asyncio.sleep(0.3)
        engine.refuse = False
        got += [out async for out in outputs]
        assert text_of(got) == "Hello, world! the end"
        # ... or fails UNAVAILABLE once the engine timeout has passed
        engine.timeout_s = 0.2
        outputs = llm.generate("r3", "a b c", common_pb2.SamplingParams(max_tokens=6))
        await outputs.__anext__()
        engine.refuse = True
        engine.lose(engine.submitted[-1][0].request_id, "engine fake-engine:1 went away")
        with pytest.raises(GenerateError, match="no engine replica could take") as info:
            async for _ in outputs:
                pass
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        assert len(llm.processor) == 0
    finally:
        await llm.close()


@run_async
async def test_a_burst_tells_the_engine_more_requests_are_coming():
    tokenizer = GatedTokenizer()
    llm = started(tokenizer=tokenizer)
    try:
        slow = asyncio.ensure_future(collect(llm, "slow prompt", request_id="slow", max_tokens=1))
        await asyncio.sleep(0.01)  # "slow" is being tokenized
        await collect(llm, "fast prompt", request_id="fast", max_tokens=1)
        tokenizer.gate.set()
        await slow
        hints = {request.request_id.split("-")[0]: more for request, _, more in llm.engine.submitted}
        assert hints == {"fast": True, "slow": False}
    finally:
        await llm.close()


def test_merged_outputs_keep_the_later_status():
    first = SampleOutput("r", 0, "a", [1], [], RUNNING, None,
                         prompt_logprobs=[common_pb2.PositionLogprobs()])
    later = SampleOutput("r", 0, "b", [2], [], STOP, "!", usage=common_pb2.Usage(completion_tokens=2))
    merged = first.merged_with(later)
    assert (merged.text, merged.token_ids, merged.finish_reason, merged.stop_reason) == ("ab", [1, 2], STOP, "!")
    assert merged.usage.completion_tokens == 2 and merged.prompt_logprobs == first.prompt_logprobs

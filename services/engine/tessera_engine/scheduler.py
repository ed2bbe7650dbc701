"""Scheduler: decides which requests run in the next step and how many tokens each.

vLLM v1's model: no prefill/decode phases, each request just has tokens
computed and tokens known; a step serves running requests first, then waiting
ones, within a token budget (max_num_batched_tokens) and a cap on running
sequences (max_num_seqs). A prompt larger than the remaining budget is split
over several steps (chunked prefill). When the KV pool runs dry the
lowest-priority, latest-arrived running request is preempted: its blocks are
freed and it goes back to the front of the waiting queue, to be recomputed.

First come, first served is kept at the engine's own resolution, a step: requests that
arrived while one step ran (or in one burst into an idle engine) join the waiting queue
together, shortest prompt first. Their order among themselves is the network's, and
shortest first gets the most of them their first token soonest (64 chat prompts sent at
once: the 33 shortest fit the first 512-token step, the first 33 in arrival order do not).
A request still waits for nothing that arrived a step after it.

After the model ran, update_from_output turns (SchedulerOutput, ModelRunnerOutput)
into the step's EngineCoreOutputs in one pass, as vLLM v1's scheduler does:
computed counts advance, sampled tokens are appended, stop conditions checked,
finished requests retired and every sample that got a token gets its output.
"""
from __future__ import annotations

import time

from tessera_engine.config import EngineConfig
from tessera_engine.kv_cache import KVCacheManager, KVCopy
from tessera_engine.outputs import (EngineCoreOutput, EngineCoreOutputs, IterationStats, ModelRunnerOutput,
                                    RequestError, RequestTiming, ScheduledSample, SchedulerOutput)
from tessera_engine.request import RequestStatus, Sample, SampleKey
from tessera_engine.speculative import (ACCEPTANCE_EMA, ACCEPTANCE_RECOVERY, INITIAL_ACCEPTANCE, SpeculativeConfig,
                                       StepCost, expected_accepted, speculation_allowed)


_FINISH = {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
           RequestStatus.FINISHED_ABORTED: "abort"}


class Scheduler:
    def __init__(self, config: EngineConfig, kv_cache: KVCacheManager, max_model_len: int,
                 token_budget: int, proposer=None, prompt_apart: bool = False) -> None:
        """proposer: speculative decoding's (speculative.py: n-gram, or the executor's draft
        model), carrying its configuration; None: no speculation. prompt_apart: prompt and
        output tokens take different matmuls (the backend plan's prompt_dense), so no chunk
        holds both: a preempted or resumed sample's recomputation stops at the end of its
        prompt, and its outputs follow in the next step."""
        self.config = config
        self.kv = kv_cache
        self.max_model_len = max_model_len
        self.priority = config.scheduling_policy == "priority"
        self.token_budget = token_budget  # tokens one step may compute (the backend plan's)
        self.prompt_apart = prompt_apart
        self.waiting: list[Sample] = []
        self.arrived: list[Sample] = []  # fcfs: added since the last step, queued at its start
        self.running: list[Sample] = []
        self.requests: dict[SampleKey, Sample] = {}
        self.num_preemptions = 0
        self.proposer = proposer
        self.speculative: SpeculativeConfig | None = proposer.config if proposer is not None else None
        # no speculation with more running samples than this (0: no limit): the configuration's
        # disable_by_batch_size; left unset, step_cost decides each step instead
        self.speculation_max_batch = (self.speculative.disable_by_batch_size or 0) if self.speculative else 0
        self.step_cost: StepCost | None = None  # set by the engine core (measured): guesses only where they pay
        self.acceptance: dict[SampleKey, float] = {}  # per sample: its guesses' acceptance rate (EMA)

    # -- queues ----------------------------------------------------------------
    def _order(self, req: Sample) -> tuple:
        return (req.priority, req.arrival_time) if self.priority else (req.arrival_time,)

    def add_request(self, req: Sample) -> None:
        self.requests[req.key] = req
        if self.priority:
            self._enqueue_waiting(req)
        else:
            self.arrived.append(req)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.arrived)

    def _queue_arrivals(self) -> None:
        """This step's arrivals join the waiting queue's end, shortest prompt first (stable:
        a request's samples stay together, equal lengths keep their arrival order)."""
        self.arrived.sort(key=lambda r: r.num_tokens)
        self.waiting.extend(self.arrived)
        self.arrived.clear()

    def _enqueue_waiting(self, req: Sample) -> None:
        """priority: into the waiting queue by (priority, arrival), so a preempted request keeps
        its rank; fcfs (a preempted request, new ones come through `arrived`): at the front."""
        if self.priority:
            key = self._order(req)
            i = 0
            while i < len(self.waiting) and self._order(self.waiting[i]) <= key:
                i += 1
            self.waiting.insert(i, req)
        else:
            self.waiting.insert(0, req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.arrived)

    def finish(self, req: Sample, status: RequestStatus) -> None:
        """Remove a request (finished or aborted) and free its blocks at once."""
        req.status = status
        if req.constraint is not None:
            req.constraint.drop()
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        elif req in self.arrived:
            self.arrived.remove(req)
        self.kv.free(req)
        self.requests.pop(req.key, None)
        self.acceptance.pop(req.key, None)
        if self.proposer is not None:
            self.proposer.release(req.key)

    def abort(self, keys: list[SampleKey]) -> list[EngineCoreOutput]:
        """Abort these samples; unknown or finished ones are ignored. One output per abort."""
        outs = []
        for key in keys:
            req = self.requests.get(key)
            if req is not None:
                self.finish(req, RequestStatus.FINISHED_ABORTED)
                outs.append(make_output(req, []))
        return outs

    def fail(self, reqs: list[Sample], error: RequestError) -> list[EngineCoreOutput]:
        """End these requests with `error` (the step that ran them failed): one output each,
        their blocks freed, and no block published for that step reused (its K/V may be unwritten)."""
        outs = []
        for req in reqs:
            if self.requests.get(req.key) is req:
                self.finish(req, RequestStatus.FINISHED_ABORTED)
                out = make_output(req, [])
                out.finish_reason, out.error = "error", error
                outs.append(out)
        self.kv.forget_free_blocks()
        return outs

    # -- scheduling --------------------------------------------------------------
    def _victim(self) -> Sample:
        if self.priority:
            return max(self.running, key=self._order)
        return self.running[-1]

    def _preempt(self, victim: Sample) -> None:
        self.running.remove(victim)
        self.kv.free(victim)
        victim.num_computed_tokens = 0
        if not victim.prompt_logprobs_done:
            victim.prompt_logprobs = []  # the prompt is recomputed from the start
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        if victim.constraint is not None:
            victim.constraint.drop()  # rebuilt from its output when it runs again
        self._enqueue_waiting(victim)
        self.num_preemptions += 1

    def schedule(self) -> SchedulerOutput:
        self.kv.release_copy_sources()  # the step that copied from them has run
        if self.arrived:
            self._queue_arrivals()
        budget = self.token_budget
        scheduled: list[ScheduledSample] = []
        preempted: list[Sample] = []
        kv_copies: list[KVCopy] = []
        now = time.time()

        # 1. running requests: one decode token each (plus guesses, speculating), or the next prefill chunk
        speculate = self.proposer is not None and (not self.speculation_max_batch
                                                   or len(self.running) <= self.speculation_max_batch)
        drafts = self._drafts(budget) if speculate else {}
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = self._chunk(req, req.num_computed_tokens, budget)
            draft = drafts.get(req.key)
            if draft and num_new == 1 and len(draft) < budget:
                if self.kv.allocate(req, 1 + len(draft)):
                    scheduled.append(ScheduledSample(req, 1 + len(draft), req.num_computed_tokens,
                                                     self.kv.block_tables(req), draft))
                    budget -= 1 + len(draft)
                    i += 1
                    continue
            while not self.kv.allocate(req, num_new):
                victim = self._victim()
                self._preempt(victim)
                preempted.append(victim)
                for s in scheduled:
                    if s.sample is victim:  # priority policy may pick one already scheduled
                        scheduled.remove(s)
                        budget += s.num_new_tokens
                        i -= 1
                        break
                if victim is req:
                    break
            else:
                scheduled.append(ScheduledSample(req, num_new, req.num_computed_tokens,
                                                   self.kv.block_tables(req)))
                budget -= num_new
                i += 1
                continue
            # req itself was preempted; running[i] is now the next request

        # 2. waiting requests, unless this step already had to preempt; one whose output
        # constraint is still compiling, or whose LoRA adapter would be one more than
        # max_loras among the running, is passed over (the queue behind it goes on)
        adapters = {r.lora for r in self.running if r.lora is not None}
        w = 0
        while (not preempted and w < len(self.waiting) and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting[w]
            if req.constraint is not None and not req.constraint.ready:
                w += 1
                continue
            if req.lora is not None and req.lora not in adapters and len(adapters) >= self.config.max_loras:
                w += 1
                continue
            hit = self.kv.find_cached_prefix(req)
            num_cached = hit.num_tokens
            num_new = self._chunk(req, num_cached, budget)
            if not self.kv.allocate(req, num_new, hit):
                break
            copy = self.kv.copy_for(req, hit)
            if copy is not None:
                kv_copies.append(copy)
            self.waiting.pop(w)
            self.kv.record_prefix_lookup(req.num_tokens, num_cached)
            req.num_computed_tokens = num_cached
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = min(num_cached, req.num_prompt_tokens)
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if req.lora is not None:
                adapters.add(req.lora)
            scheduled.append(ScheduledSample(req, num_new, num_cached, self.kv.block_tables(req)))
            budget -= num_new

        return SchedulerOutput(scheduled, preempted, self.token_budget - budget, kv_copies)

    def _chunk(self, req: Sample, num_computed: int, budget: int) -> int:
        """How many of the sample's tokens from num_computed on its next chunk takes."""
        end = req.num_tokens
        if self.prompt_apart and num_computed < req.num_prompt_tokens:
            end = req.num_prompt_tokens
        return min(end - num_computed, budget)

    def _drafts(self, budget: int) -> dict[SampleKey, list[int]]:
        """This step's guesses, by sample: none unless, by the measured step cost and the
        samples' acceptance rates, they are expected to raise the step's tokens per second."""
        decoding = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        k = self.speculative.num_speculative_tokens
        # before any lookup: would k guesses a sample pay even at the best acceptance rate of any
        # of them? At a large batch no (a step's time grows with its rows), and the lookups
        # themselves (a millisecond or more for 64 samples) are skipped
        best = max((self.acceptance.get(r.key, INITIAL_ACCEPTANCE) for r in decoding), default=INITIAL_ACCEPTANCE)
        if self.step_cost is not None and not self.step_cost.pays(
                len(self.running), len(decoding) * k, len(decoding) * expected_accepted(best, k), len(decoding),
                self.proposer.cost(len(decoding), k)):
            return {}
        items = []
        room = budget - len(self.running)
        for req in decoding:
            n = self._guess_count(req, room)
            if n > 0:
                items.append((req.key, req.all_token_ids, n))
                room -= n
        drafts = self.proposer.propose_many(items) if items else {}
        if drafts and self.step_cost is not None:
            extra = sum(expected_accepted(self.acceptance.get(key, INITIAL_ACCEPTANCE), len(draft))
                        for key, draft in drafts.items())
            # the proposals are made (their cost is spent): only the longer step counts now
            if not self.step_cost.pays(len(self.running), sum(map(len, drafts.values())), extra, len(decoding)):
                return {}
        return drafts

    def _guess_count(self, req: Sample, room: int) -> int:
        """How many tokens to guess for a decoding sample (speculative decoding): within the
        step's room, the sample's max_tokens and the model's length; 0 where not allowed."""
        if not speculation_allowed(req):
            return 0
        return max(0, min(self.speculative.num_speculative_tokens, room,
                          req.params.max_tokens - req.num_output_tokens - 1, self.max_model_len - req.num_tokens - 1))

    def update_from_output(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> EngineCoreOutputs:
        """Apply one step's model output; returns the step's outputs and its stats (the core
        fills in the step's number and duration)."""
        now = time.time()
        outs: list[EngineCoreOutput] = []
        num_prompt_tokens = num_drafts = num_draft_tokens = num_accepted = 0
        for s in sched.scheduled:
            req = s.sample
            req.num_steps += 1
            accepted = result.accepted.get(req.key, [])
            # with guesses, only the last known token and the accepted guesses were computed
            req.num_computed_tokens += 1 + len(accepted) if s.draft_token_ids else s.num_new_tokens
            rate = self.acceptance.get(req.key)
            if s.draft_token_ids:
                num_drafts += 1
                num_draft_tokens += len(s.draft_token_ids)
                num_accepted += len(accepted)
                rate = INITIAL_ACCEPTANCE if rate is None else rate
                self.acceptance[req.key] = ((1 - ACCEPTANCE_EMA) * rate
                                            + ACCEPTANCE_EMA * len(accepted) / len(s.draft_token_ids))
            elif rate is not None:
                self.acceptance[req.key] = rate + ACCEPTANCE_RECOVERY * (INITIAL_ACCEPTANCE - rate)
            chunk_prompt_logprobs = result.prompt_logprobs.get(req.key)
            if chunk_prompt_logprobs is not None:
                req.prompt_logprobs.extend(chunk_prompt_logprobs)
            token = result.sampled.get(req.key)
            if token is None:
                continue  # a prefill chunk short of the prompt's end
            new_tokens = []
            for token in (*accepted, token):  # each checked as if it came in a step of its own
                new_tokens.append(token)
                req.append_output_token(token)
                done = req.check_stop(self.max_model_len)
                if req.constraint is not None and req.constraint.accept(token) and not done:
                    req.status, done = RequestStatus.FINISHED_STOPPED, True  # the constraint is complete
                if done:
                    self.finish(req, req.status)
                    break
            if req.first_token_time is None:
                req.first_token_time = now
                req.num_prefill_steps = req.num_steps
                num_prompt_tokens += req.num_prompt_tokens
            req.last_token_time = now
            out = make_output(req, new_tokens, now)
            lp = result.logprobs.get(req.key)
            if lp is not None:  # one a new token (a stop may have cut the accepted guesses short)
                out.logprobs = [*result.accepted_logprobs.get(req.key, ()), lp][:len(new_tokens)]
            if not req.prompt_logprobs_done:
                out.prompt_logprobs = req.prompt_logprobs
                req.prompt_logprobs_done = True
            outs.append(out)
        return EngineCoreOutputs(outs, IterationStats(0, 0.0, sched.num_batched_tokens, num_prompt_tokens,
                                                      sum(len(o.new_token_ids) for o in outs), len(sched.preempted),
                                                      num_drafts, num_draft_tokens, num_accepted))


def make_output(req: Sample, tokens: list[int], now: float | None = None) -> EngineCoreOutput:
    """A sample's output carrying these new tokens; with its timing once it has finished."""
    out = EngineCoreOutput(
        request_id=req.request_id, index=req.index, client_id=req.client_id,
        new_token_ids=tokens, finish_reason=_FINISH.get(req.status),
        stop_token_id=req.stop_token_id, num_prompt_tokens=req.num_prompt_tokens,
        num_cached_tokens=max(req.num_cached_tokens, 0))
    if out.finish_reason is not None:
        out.timing = RequestTiming(req.queued_time, req.first_scheduled_time, req.first_token_time,
                                   req.last_token_time, now or time.time(), req.num_output_tokens,
                                   req.num_steps, req.num_prefill_steps, req.num_preemptions)
    return out

"""Structured output: constraints compiled against the model's tokenizer, applied as token masks.

A request's constraint (StructuredOutputSpec: JSON schema, any JSON object, regex, grammar
or choices) becomes an llguidance grammar (JSON with its whitespace, numbers and strings
bounded where the schema states no limit: tessera.common.constraints, so a greedy model
cannot write digits until max_tokens), and each sample gets a matcher over the model's
own vocabulary. Compiling (building the matcher) runs on a worker thread, never in a step:
the request waits in the scheduler's queue, skipped, until its matcher is ready (as vLLM's
structured-output manager does), and fails with INVALID_ARGUMENT if the constraint does not
compile. Each step the sampler asks every constrained row for its mask of allowed next
tokens; the token sampled is fed back to the matcher, and the sample stops once the
matcher allows nothing more. The matcher is dropped when its sample finishes, is aborted
or is preempted, and rebuilt (the output so far replayed through it) when it resumes.
"""
from __future__ import annotations

import concurrent.futures
import logging
import threading

import torch

from tessera.common.constraints import ConstraintError, StructuredOutputSpec

log = logging.getLogger(__name__)

def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [B, ceil(V / 32)] bitmask (bit j of word w: token 32 w + j allowed) -> bool [B, V]."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    return ((bitmask.unsqueeze(-1) >> bits) & 1).flatten(1)[:, :vocab_size].bool()


class Constraint:
    """One sample's matcher (its grammar state), built on the manager's worker thread."""

    def __init__(self, manager: "StructuredOutputManager", spec: StructuredOutputSpec) -> None:
        self.manager = manager
        self.spec = spec
        self.future: concurrent.futures.Future = manager.compile(spec)
        self.matcher = None  # a copy of the compiled one, made when first needed; None after drop()

    @property
    def ready(self) -> bool:
        return self.future.done()

    def error(self) -> str | None:
        """Why the constraint did not compile, once done; None while compiling or when it did."""
        if not self.future.done():
            return None
        exc = self.future.exception()
        return None if exc is None else str(exc)

    def _matcher(self, output_token_ids: list[int]):
        if self.matcher is None:
            self.matcher = self.future.result().deep_copy()
            # resumed after a preemption: the output so far goes through the fresh matcher
            if output_token_ids and not self.matcher.consume_tokens(output_token_ids):
                raise RuntimeError(f"replaying the output through the grammar failed: {self.matcher.get_error()}")
        return self.matcher

    def allows(self, token_id: int, output_token_ids: list[int]) -> bool:
        """Whether the constraint allows `token_id` next (one token checked, no mask built)."""
        return self._matcher(output_token_ids).validate_tokens([token_id]) == 1

    def fill_bitmask(self, bitmask: torch.Tensor, row: int, output_token_ids: list[int]) -> None:
        """Write this sample's allowed next tokens into row `row` of an int32 bitmask."""
        m = self._matcher(output_token_ids)
        v = bitmask[row]
        m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())

    def accept(self, token_id: int) -> bool:
        """Advance past the sampled token; True when the constraint then allows nothing more
        (the sample is complete). A token the mask did not allow puts the matcher in error."""
        m = self.matcher
        if m is None:
            return False
        if not m.consume_token(token_id):
            log.warning("token outside the constraint", extra={"token": token_id, "error": m.get_error()})
            return True
        return m.is_stopped()

    def drop(self) -> None:
        self.matcher = None


class StructuredOutputManager:
    """Compiles constraints on one worker thread against the model's tokenizer, cached by
    constraint; one per engine. The tokenizer wrapper (seconds of CPU, more on busy cores,
    and tens of MiB kept; the HF tokenizer it is made from is dropped) is built on the worker
    too, for the first constraint (or by `prepare()`): an engine that never sees one never
    pays its CPU or memory. Built at every engine's warm-up instead, a test run of dozens
    of engines on 2 cores was slowed enough to time out a drain (kept lazy for now)."""

    CACHE_SIZE = 256

    def __init__(self, tokenizer_factory, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._factory = tokenizer_factory
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="structured-output")
        self._tokenizer: concurrent.futures.Future | None = None  # built with the first constraint
        self._lock = threading.Lock()
        self._cache: dict[StructuredOutputSpec, concurrent.futures.Future] = {}

    def _build_tokenizer(self, factory):
        import llguidance.hf

        hf_tokenizer = factory()
        tok = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=self.vocab_size)
        log.info("structured output ready", extra={"backend": "llguidance", "vocab_size": self.vocab_size})
        return tok

    def prepare(self) -> None:
        """Start building the tokenizer wrapper now, in the background."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = self._pool.submit(self._build_tokenizer, self._factory)

    def compile(self, spec: StructuredOutputSpec) -> concurrent.futures.Future:
        """A future of the constraint's pristine matcher, shared by every sample with this
        constraint (each copies it); a constraint that does not compile fails the same way
        each time, so errors are cached too."""
        self.prepare()
        with self._lock:
            fut = self._cache.get(spec)
            if fut is None:
                if len(self._cache) >= self.CACHE_SIZE:
                    self._cache.pop(next(iter(self._cache)))
                fut = self._cache[spec] = self._pool.submit(self._compile, spec)
            return fut

    def _compile(self, spec: StructuredOutputSpec):
        import llguidance

        m = llguidance.LLMatcher(self._tokenizer.result(), spec.grammar(), log_level=0)
        if m.is_error():
            raise ConstraintError(f"{spec.kind}: {m.get_error()}")
        return m

    def wait_any(self, constraints: list[Constraint], timeout_s: float) -> None:
        """Block until one of these constraints is compiled, or the timeout (an idle step's wait)."""
        pending = [c.future for c in constraints if not c.ready]
        if pending:
            concurrent.futures.wait(pending, timeout=timeout_s, return_when=concurrent.futures.FIRST_COMPLETED)

    def new_bitmask(self, rows: int) -> torch.Tensor:
        return torch.full((rows, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def hf_tokenizer_of(directory: str, gguf_file: str | None):
    """The model's Hugging Face tokenizer (fast), as the tokenizer service loads it."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file)

"""Folding one sample's consecutive engine outputs (tessera.v1.RequestOutput) into one.

Both ends of the engine's Session stream need it: the engine, when a session's reader
falls behind and its waiting step messages are folded together (tessera_engine.session_outbox),
and the frontend, when outputs that waited for a restarted tokenizer are resumed as one.
"""
from __future__ import annotations

import functools
from typing import Sequence

from tessera.v1 import common_pb2, engine_pb2

RUNNING = common_pb2.FINISH_REASON_UNSPECIFIED


def merged_request_output(earlier: engine_pb2.RequestOutput,
                          later: engine_pb2.RequestOutput) -> engine_pb2.RequestOutput:
    """`earlier` then `later` (the same sample's next output) as one new message: the token ids
    and logprobs joined, the later one's status, the prompt logprobs of whichever has them."""
    merged = engine_pb2.RequestOutput()
    merged.CopyFrom(later)
    del merged.new_token_ids[:]
    merged.new_token_ids.extend(earlier.new_token_ids)
    merged.new_token_ids.extend(later.new_token_ids)
    del merged.logprobs[:]
    merged.logprobs.extend(earlier.logprobs)
    merged.logprobs.extend(later.logprobs)
    if earlier.prompt_logprobs and not merged.prompt_logprobs:
        merged.prompt_logprobs.extend(earlier.prompt_logprobs)
    merged.num_cached_tokens = max(earlier.num_cached_tokens, later.num_cached_tokens)
    return merged


def merged_request_outputs(outputs: Sequence[engine_pb2.RequestOutput]) -> engine_pb2.RequestOutput:
    """One sample's consecutive outputs, in order, as one new message."""
    if len(outputs) == 1:
        only = engine_pb2.RequestOutput()
        only.CopyFrom(outputs[0])
        return only
    return functools.reduce(merged_request_output, outputs)

"""What serving the real Gemma 3 270M file holds (issue 38): a 4k-token request keeps its whole
context only in the global layers' KV cache group; each sliding-window group (window 512) holds
~512 tokens' worth of blocks once it decodes, and the window behind a chunk plus the chunk while
the prompt is prefilled; every block comes back when it ends. The engine at its defaults (bf16)."""
from __future__ import annotations

import pytest

from tessera_engine.config import EngineConfig
from tessera_engine.core import EngineCore
from tessera_engine.request import EngineCoreRequest
from tessera_engine.sampling_params import SamplingParams

from helpers.gemma3_file import gemma3_gguf

pytestmark = [pytest.mark.unit, pytest.mark.slow]

PROMPT_TOKENS = 4096
CHUNK = 512
NEW = 8


def test_a_4k_token_request_holds_the_window_in_each_sliding_group_and_everything_in_the_global_one():
    core = EngineCore(EngineConfig(model=str(gemma3_gguf()), max_num_batched_tokens=CHUNK, max_model_len=8192))
    kv = core.kv_cache
    bs = core.config.block_size
    windows = kv.windows
    assert windows.count(None) == 1 and set(windows) == {512, None} and len(windows) == 6
    prompt = [(37 * i) % 20000 + 1000 for i in range(PROMPT_TOKENS)]
    core.add_request(EngineCoreRequest("long", prompt, SamplingParams(temperature=0.0, max_tokens=NEW,
                                                                       ignore_eos=True)))
    most = [0] * len(windows)
    last = None
    while core.has_unfinished():
        core.step()
        for r in core.scheduler.running:
            last = kv.held_blocks(r)
            most = [max(a, b) for a, b in zip(most, last)]
    full = windows.index(None)
    total = PROMPT_TOKENS + NEW - 1  # the last token is sampled, never computed
    assert last[full] == -(-total // bs)  # the global group: every block of the context
    for g, w in enumerate(windows):
        if w is None:
            continue
        assert last[g] <= -(-w // bs) + 1, (g, last)  # decoding: the window's blocks
        assert most[g] <= -(-(w + CHUNK - 1) // bs) + 1, (g, most)  # prefilling: the window behind a chunk + it
    # what the pool holds for it, all groups together, against the same request with full attention
    # on every layer: about 4k + 5 x 512 tokens' worth instead of 6 x 4k
    assert sum(last) * 3 < len(windows) * -(-total // bs)
    assert kv.num_free_blocks == kv.num_blocks

"""The prompts a benchmark sends: synthetic ones built from the server's vocabulary
(`random`), a shared long system prompt before each (`prefix`, to show the prefix cache), the
first turn of ShareGPT conversations (`sharegpt`), or a JSONL file of prompts in the format of
`vllm bench serve --dataset-name custom` (`custom`)."""
from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass

from tessera.bench.vocab import Vocabulary

# Tokenized once to find ordinary word pieces: random ids over the whole vocabulary would pick
# special and control tokens, which some servers refuse in a prompt and which change its length.
SEED_TEXT = """The history of science is the study of the development of science and scientific knowledge,
including both the natural and social sciences. Science is a body of empirical, theoretical, and practical
knowledge about the natural world, produced by scientists who emphasize the observation, explanation, and
prediction of real-world phenomena. Early ships sailed across the ocean carrying grain, wool, timber, silver
and spices between harbours; merchants kept careful ledgers of prices, weather, tides and distances.
Mountains, rivers, forests, deserts and islands shape where people build villages, roads, bridges, markets,
schools and gardens. Music, painting, poetry, architecture and mathematics grew together in many cities.
Engineers measure voltage, current, pressure, temperature and velocity; chemists weigh compounds, mix
solutions and record reactions; biologists observe cells, proteins, insects, birds and whales. Children
learn to count apples, read stories, draw maps and ask why the sky is blue at noon and red at sunset."""
DETOKENIZE_CONCURRENCY = 32
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048
TOKENIZE_CONCURRENCY = 32


@dataclass
class SampleRequest:
    prompt: str                 # the user message (chat) or the text after `system` (completions, gRPC)
    prompt_len: int             # tokens the dataset meant (the server's usage is what is reported)
    expected_output_len: int    # max_tokens
    system: str | None = None   # a shared system prompt (the prefix dataset)

    def text(self) -> str:
        """The whole prompt as one text (completions, gRPC)."""
        return f"{self.system}\n{self.prompt}" if self.system else self.prompt


def lengths(rng: random.Random, mean: int, range_ratio: float, n: int) -> list[int]:
    """n lengths uniform in [mean*(1-r), mean*(1+r)], at least 1."""
    lo, hi = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


async def vocabulary_ids(vocab: Vocabulary) -> list[int]:
    ids = sorted(set(await vocab.tokenize(SEED_TEXT)))
    if not ids:
        raise RuntimeError("the server's /tokenize gave no tokens for the seed text")
    return ids


async def _texts(vocab: Vocabulary, id_lists: list[list[int]]) -> list[str]:
    gate = asyncio.Semaphore(DETOKENIZE_CONCURRENCY)

    async def one(ids: list[int]) -> str:
        async with gate:
            return await vocab.detokenize(ids)

    return list(await asyncio.gather(*(one(ids) for ids in id_lists)))


async def random_requests(vocab: Vocabulary, n: int, input_len: int, output_len: int, range_ratio: float,
                          seed: int, prefix_len: int = 0) -> list[SampleRequest]:
    """n prompts of random word pieces (and one shared system prompt of prefix_len tokens)."""
    rng = random.Random(seed)
    ids = await vocabulary_ids(vocab)
    in_lens = lengths(rng, input_len, range_ratio, n)
    out_lens = lengths(rng, output_len, range_ratio, n)
    id_lists = [[rng.choice(ids) for _ in range(length)] for length in in_lens]
    texts = await _texts(vocab, id_lists)
    system = None
    if prefix_len > 0:
        system = (await _texts(vocab, [[rng.choice(ids) for _ in range(prefix_len)]]))[0]
    return [SampleRequest(text, length + prefix_len, out, system)
            for text, length, out in zip(texts, in_lens, out_lens)]


async def sharegpt_requests(vocab: Vocabulary, path: str, n: int, seed: int,
                            output_len: int | None = None) -> list[SampleRequest]:
    """n first turns of ShareGPT conversations (a JSON list of {"conversations": [{"from", "value"}, ...]}),
    output length that of the recorded answer unless `output_len`; too short or too long ones skipped."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    pairs = [(c["conversations"][0]["value"], c["conversations"][1]["value"])
             for c in data if len(c.get("conversations", [])) >= 2]
    random.Random(seed).shuffle(pairs)
    chosen: list[SampleRequest] = []
    for prompt, answer in pairs:
        if len(chosen) >= n:
            break
        prompt_len = len(await vocab.tokenize(prompt))
        out_len = output_len or len(await vocab.tokenize(answer))
        if prompt_len < SHAREGPT_MIN_LEN or out_len < SHAREGPT_MIN_LEN:
            continue
        if prompt_len > SHAREGPT_MAX_PROMPT_LEN or prompt_len + out_len > SHAREGPT_MAX_TOTAL_LEN:
            continue
        chosen.append(SampleRequest(prompt, prompt_len, out_len))
    if not chosen:
        raise ValueError(f"{path}: no usable conversations")
    return chosen


def read_custom(path: str) -> list[dict]:
    """The rows of a custom dataset: a JSONL file, one JSON object per line with a "prompt"
    string and optionally "output_tokens" (the request's max tokens), as vLLM's CustomDataset
    reads it (other fields are ignored; blank lines skipped). ValueError naming the file and
    line of a bad row."""
    if not path.endswith(".jsonl"):
        raise ValueError(f"{path}: a custom dataset is a .jsonl file (one JSON object per line), as vLLM's")
    rows: list[dict] = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not JSON ({exc.msg})") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise ValueError(f"{path}:{number}: expected an object with a \"prompt\" string")
            if "output_tokens" in row:
                out = row["output_tokens"]
                if isinstance(out, bool) or not isinstance(out, (int, float)) or out != int(out) or out < 1:
                    raise ValueError(f"{path}:{number}: \"output_tokens\" must be a positive integer, got {out!r}")
                row["output_tokens"] = int(out)
            row["line"] = number
            rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no prompts")
    return rows


def sample_custom(rows: list[dict], n: int, seed: int, output_len: int | None, shuffle: bool = True,
                  oversample: bool = True) -> list[tuple[str, int]]:
    """(prompt, max tokens) of n rows, chosen as vLLM's CustomDataset chooses them: the rows
    shuffled by Python's random seeded with `seed` (unless not `shuffle`), the first n taken; each
    one's max tokens `output_len`, or its "output_tokens" when output_len is None or -1; fewer rows
    than n: random picks among them (seeded again) fill up to n, unless not `oversample`."""
    rows = list(rows)
    if shuffle:
        random.Random(seed).shuffle(rows)  # the same order as vLLM's random.seed(seed); random.shuffle(rows)
    chosen: list[tuple[str, int]] = []
    for row in rows[:n]:
        if output_len is None or output_len == -1:
            if "output_tokens" not in row:
                raise ValueError(f"line {row.get('line', '?')}: no \"output_tokens\" and no --custom-output-len "
                                 "(-1 takes each row's)")
            chosen.append((row["prompt"], row["output_tokens"]))
        else:
            chosen.append((row["prompt"], output_len))
    if oversample and len(chosen) < n:
        rng = random.Random(seed)
        chosen += [rng.choice(chosen) for _ in range(n - len(chosen))]
    return chosen


async def custom_requests(vocab: Vocabulary, path: str, n: int, seed: int, output_len: int | None,
                          shuffle: bool = True, oversample: bool = True) -> list[SampleRequest]:
    """n prompts of a custom JSONL dataset (read_custom, sample_custom), sent as they are: the chat
    backend sends each as the user message (the server applies its chat template), the others as
    the whole prompt. Their lengths are counted with the vocabulary (the server's usage, when it
    reports it, is what the result counts)."""
    chosen = sample_custom(read_custom(path), n, seed, output_len, shuffle, oversample)
    gate = asyncio.Semaphore(TOKENIZE_CONCURRENCY)

    async def length(prompt: str) -> int:
        async with gate:
            return len(await vocab.tokenize(prompt))

    lens = await asyncio.gather(*(length(prompt) for prompt, _ in chosen))
    return [SampleRequest(prompt, prompt_len, out) for (prompt, out), prompt_len in zip(chosen, lens)]

#!/usr/bin/env python
"""DetokenizeStream throughput: the tokenizer service vs the same decoding in-process.

A benchmark, not a test. 64 requests of 512 generated tokens each are detokenized
step by step, interleaved the way the frontend feeds the tokenizer: one
DetokenizeStreamRequest per engine step carrying ONE new token for each of the 64
requests. The first item of a request carries `open` (two stop strings that never
match, skip_special_tokens, the request's chat prompt ids); the last carries
finished=true. Token sequences are real text (English prose, code, JSON, maths,
French, German, Spanish, Russian, Greek, Arabic, Hindi, Thai, Chinese, Japanese,
Korean, emoji incl. ZWJ sequences and flags) tokenized with the model's tokenizer,
each request a different arrangement of the passages, ending in the EOS token.

Sides (all measured in each repeat, in rotating order so drift hits every side):
  inprocess        IncrementalDetokenizer per request in this process: same token
                   sequences, same stop strings, same prompt context. The baseline.
  session          the service's DetokenizeSession.process() on the same prebuilt
                   messages, in this process: the server's per-step work (proto in,
                   proto out, validation, tallies) without gRPC.
  service          the tokenizer service as its own process (python -m
                   tessera_tokenizer on a free loopback port, waited for SERVING),
                   one stream, lock-step: send a step, await its reply, as the
                   frontend does. The headline.
  service_pipe<D>  the same stream with D steps in flight (--pipeline-depth, 0 = skip).
  frontend_client  lock-step through the frontend's own DetokenizeStream client
                   (tessera_frontend.tokenizer_client): its queue + future plumbing.

The request messages are built before the clock starts (building them is the
frontend's cost, reported separately as build_messages_s). tokens/s = 64 x 512 /
wall time of the whole run (first send to last reply). Medians over --repeats.
Server and client CPU seconds per run are recorded too (psutil): on a 2-core box
client and server share the cores, so wall time is not the server's cost alone.
tok/cpu-s (tokens per CPU second of the process doing the detokenizing: the server
for the service sides, this process otherwise) is the figure that holds up on a busy
machine; `service_vs_inprocess_cpu` is the service's over the in-process one.

Correctness: for every request the concatenated deltas from the service (and from
the session and frontend-client sides) must equal the in-process text; every result
must have no error, no stop match, tokens_consumed=1 and finished only on the last
step. The in-process text is also compared with a one-shot decode of the whole
sequence (reported; a mismatch there is a detokenizer bug, not a transport one).

Target: the service sustains >= 20x the engine's own output tokens/s at 64 requests
(so that detokenizing never holds the engine back), the engine's figure read from
results/engine_throughput.json (scenarios.batch64.engine.tokens_per_s.median) or given
with --engine-tokens-per-s.

  python benchmarks/detokenize_throughput.py
  python benchmarks/detokenize_throughput.py --repeats 5 --pipeline-depth 8
  python benchmarks/detokenize_throughput.py --engine-tokens-per-s 900 --profile

Prints a table, saves results/detokenize_throughput.json (--out), and ends with
`service_vs_inprocess=<service tok/s / in-process tok/s>`.
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import logging
import os
import pathlib
import pstats
import random
import sys
import tempfile
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import grpc  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from common import environment, fmt, format_table, log  # noqa: E402
from tessera.bench.metrics import median, summarize  # noqa: E402
from tessera.common.grpc_service import CHANNEL_OPTIONS  # noqa: E402
from tessera.launch import Service, free_port  # noqa: E402
from tessera.v1 import tokenizer_pb2, tokenizer_pb2_grpc  # noqa: E402
from tessera_tokenizer.detokenizer import IncrementalDetokenizer  # noqa: E402
from tessera_tokenizer.tokenizer import Tokenizer  # noqa: E402

TARGET_VS_ENGINE = 20.0
DEFAULT_STOPS = ("<|never-stop|>", "\n\n### END OF ANSWER ###")

# Real, varied text: what a chat model writes. Each request's output is the passages
# in its own seeded order, so no two requests carry the same token sequence.
PASSAGES: list[str] = [
    # English prose
    "Photosynthesis is the process by which green plants, algae and some bacteria turn light into "
    "chemical energy. In the chloroplasts, chlorophyll absorbs mostly red and blue light; that energy "
    "splits water molecules, releasing oxygen, and drives the synthesis of ATP and NADPH. In the Calvin "
    "cycle those carriers fix carbon dioxide into three-carbon sugars, which the plant then builds into "
    "glucose, starch and cellulose. Nearly every food chain on Earth starts here.",
    "Sure! Here are three tips for better sleep:\n\n1. **Keep a consistent schedule.** Go to bed and wake "
    "up at the same time every day, even on weekends.\n2. **Dim the lights an hour before bed.** Bright "
    "screens delay the release of melatonin.\n3. **Watch the caffeine.** Its half-life is about five "
    "hours, so an afternoon coffee can still be in your system at midnight.\n\nIf you still can't sleep "
    "after 20 minutes, get up and read something dull until you feel drowsy.",
    "The printing press, introduced in Mainz around 1450, cut the cost of books by more than an order of "
    "magnitude. Within fifty years presses were running in over two hundred European cities. Cheaper books "
    "spread literacy, standardised vernacular spelling, let scholars compare identical copies of a text, "
    "and carried pamphlets that fuelled the Reformation. Historians still argue about how much credit the "
    "press deserves, but few doubt it accelerated the exchange of ideas.",
    "Compound interest means you earn interest on your interest. Suppose you deposit $1,000 at 5% per year, "
    "compounded annually. After one year you have $1,050; after two, $1,102.50; after ten, about $1,628.89. "
    "With simple interest you would have only $1,500 after ten years. The formula is A = P(1 + r/n)^(nt), "
    "where P is the principal, r the annual rate, n the number of compounding periods per year and t the "
    "number of years.",
    # code
    "Here is a small Python function that merges two sorted lists:\n\n```python\ndef merge(a: list[int], "
    "b: list[int]) -> list[int]:\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n    i = j = 0\n"
    "    out = []\n    while i < len(a) and j < len(b):\n        if a[i] <= b[j]:\n            out.append(a[i])\n"
    "            i += 1\n        else:\n            out.append(b[j])\n            j += 1\n    out.extend(a[i:])\n"
    "    out.extend(b[j:])\n    return out\n```\n\nIt runs in O(n + m) time and never mutates its inputs.",
    "To center a div both ways, use flexbox on the parent:\n\n```css\n.parent {\n  display: flex;\n"
    "  justify-content: center;  /* horizontal */\n  align-items: center;      /* vertical */\n  min-height: 100vh;\n}"
    "\n```\n\nOr with grid: `display: grid; place-items: center;`. Both work in every modern browser.",
    "The API returned this JSON:\n\n```json\n{\"id\": \"ord_8F2kQ\", \"status\": \"shipped\", \"items\": "
    "[{\"sku\": \"A-1042\", \"qty\": 2, \"price\": 19.99}, {\"sku\": \"B-7731\", \"qty\": 1, \"price\": 4.5}], "
    "\"total\": 44.48, \"currency\": \"EUR\", \"tracking\": null}\n```\n\nNote that `tracking` is null until "
    "the carrier scans the parcel.",
    # maths
    "By the Pythagorean theorem, a² + b² = c². For a right triangle with legs 3 and 4, c = √(9 + 16) = 5. "
    "More generally, the distance between (x₁, y₁) and (x₂, y₂) is √((x₂ − x₁)² + (y₂ − y₁)²). In three "
    "dimensions add (z₂ − z₁)². The integral ∫₀^∞ e^(−x²) dx = √π / 2, and Σ_{n≥1} 1/n² = π²/6 ≈ 1.6449.",
    # chat with emoji
    "Happy birthday!! 🎉🎂🥳 Hope your day is full of sunshine ☀️ and cake 🍰. Can't wait to see you at the "
    "party 🙌 — bring your dancing shoes 💃🕺! P.S. the dog 🐶 says hi too 🐾❤️",
    "Our family trip: 👨‍👩‍👧‍👦 drove to the coast 🚗💨, swam 🏊‍♀️, ate way too much 🍦🍦🍦 and watched the "
    "sunset 🌅. Next stop: 🇯🇵 Japan or 🇮🇹 Italy? Vote below 👇🏽 (thumbs up 👍🏻 for Japan, heart 🫶🏿 for Italy).",
    # European languages
    "La Révolution française commence en 1789 avec la convocation des États généraux. La prise de la "
    "Bastille, le 14 juillet, devient le symbole de la fin de l'absolutisme. En août, l'Assemblée "
    "constituante abolit les privilèges et adopte la Déclaration des droits de l'homme et du citoyen. "
    "Les années suivantes sont marquées par la guerre, la Terreur et, finalement, l'ascension de Bonaparte.",
    "Ein Kühlschrank transportiert Wärme von innen nach außen. Das Kältemittel verdampft im Inneren bei "
    "niedrigem Druck und nimmt dabei Wärme auf; der Verdichter presst den Dampf zusammen, sodass er sich "
    "erhitzt, und im Verflüssiger an der Rückseite gibt er diese Wärme an die Küche ab. Übrigens: Ein "
    "Kühlschrank mit offener Tür heizt den Raum insgesamt – er kühlt ihn nicht.",
    "¿Por qué el cielo es azul? La luz del sol contiene todos los colores, pero las moléculas del aire "
    "dispersan mucho más la luz de longitud de onda corta. Por eso vemos azul en casi todas las direcciones. "
    "Al atardecer, la luz atraviesa más atmósfera, el azul se pierde por el camino y predominan el naranja "
    "y el rojo. ¡Es la dispersión de Rayleigh!",
    "Vou te contar uma receita rápida de panquecas: misture 1 xícara de farinha, 1 ovo, 1 xícara de leite, "
    "uma colher de açúcar e uma pitada de sal. Aqueça a frigideira, unte com manteiga e despeje uma concha "
    "da massa. Quando aparecerem bolhinhas, vire. Sirva com mel, frutas ou doce de leite. Bom apetite!",
    "Фотосинтез — это процесс, при котором растения превращают энергию света в химическую энергию. "
    "Хлорофилл поглощает свет, вода расщепляется, выделяется кислород, а углекислый газ превращается в "
    "сахара. Без фотосинтеза не было бы ни кислорода в атмосфере, ни большей части пищи на Земле.",
    "Η δημοκρατία γεννήθηκε στην αρχαία Αθήνα τον 5ο αιώνα π.Χ. Οι πολίτες συγκεντρώνονταν στην Πνύκα για "
    "να ψηφίσουν νόμους, ενώ πολλά αξιώματα κληρώνονταν. Βέβαια, γυναίκες, δούλοι και μέτοικοι δεν είχαν "
    "δικαίωμα ψήφου.",
    "Polska leży w Europie Środkowej, nad Morzem Bałtyckim. Stolicą jest Warszawa, a najdłuższą rzeką "
    "Wisła. Źródła żubrów w Puszczy Białowieskiej przyciągają turystów z całego świata. Dziękuję za pytanie!",
    "Türkiye'nin en kalabalık şehri İstanbul'dur; Boğaziçi, şehri Avrupa ve Asya yakalarına ayırır. "
    "Çay, günlük hayatın ayrılmaz bir parçasıdır ve ince belli bardaklarda servis edilir.",
    # other scripts
    "الذكاء الاصطناعي هو فرع من علوم الحاسوب يهدف إلى بناء أنظمة قادرة على التعلّم والاستنتاج. تعتمد "
    "الشبكات العصبية على طبقات من الوحدات الحسابية التي تتعلّم من البيانات، وتُستخدم اليوم في الترجمة "
    "الآلية والتعرّف على الصور والكلام.",
    "भारत की राजधानी नई दिल्ली है। हिंदी और अंग्रेज़ी केंद्र सरकार की आधिकारिक भाषाएँ हैं, लेकिन संविधान "
    "बाईस भाषाओं को मान्यता देता है। दीवाली, होली और ईद जैसे त्योहार पूरे देश में मनाए जाते हैं।",
    "กรุงเทพมหานครเป็นเมืองหลวงของประเทศไทย มีชื่อเสียงด้านอาหารริมทาง วัดวาอาราม และตลาดน้ำ "
    "ขอบคุณมากครับ",
    "光合作用是植物利用光能，把二氧化碳和水转化为葡萄糖并释放氧气的过程。它主要发生在叶绿体中，"
    "分为光反应和暗反应两个阶段。没有光合作用，地球上的大多数生命都无法生存。你还想了解哪一部分？",
    "学习一门新语言的好习惯：每天坚持二十分钟；多听多说，不怕犯错；用新词造句；找一个语言伙伴；"
    "看带字幕的电影。最重要的是保持兴趣，循序渐进。加油！💪",
    "東京は日本の首都で、約千四百万人が暮らしています。朝の通勤ラッシュは有名ですが、電車は驚くほど"
    "時間に正確です。週末には浅草寺を訪れたり、隅田川沿いを散歩したりするのがおすすめです。"
    "ラーメン🍜とお寿司🍣もぜひ試してください！",
    "김치는 배추와 무에 고춧가루, 마늘, 생강, 젓갈을 넣어 발효시킨 한국의 대표 음식입니다. 겨울을 "
    "앞두고 온 가족이 함께 김장을 하는 전통은 유네스코 인류무형문화유산으로 등재되었습니다. 맛있게 드세요! 😋",
    "Vietnamese: Hà Nội là thủ đô của Việt Nam, nổi tiếng với phở, bún chả và cà phê trứng. "
    "Hồ Hoàn Kiếm nằm ngay giữa trung tâm thành phố cổ.",
]


# -- arguments ---------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64, help="interleaved requests (default 64)")
    ap.add_argument("--tokens", type=int, default=512, help="generated tokens per request (default 512)")
    ap.add_argument("--repeats", type=int, default=3, help="measurements per side; medians are quoted (default 3)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs per side first (default 1)")
    ap.add_argument("--pipeline-depth", type=int, default=4,
                    help="steps in flight for the pipelined service side (default 4; 0 or 1 skips it)")
    ap.add_argument("--no-frontend-client", action="store_true",
                    help="skip the side that goes through the frontend's DetokenizeStream client")
    ap.add_argument("--no-session", action="store_true", help="skip the in-process DetokenizeSession side")
    ap.add_argument("--stop", action="append", default=None,
                    help=f"stop string sent in `open` (repeatable; default {list(DEFAULT_STOPS)!r}); "
                         "must not occur in the text")
    ap.add_argument("--no-stop", action="store_true", help="send no stop strings (the whole-step decode path)")
    ap.add_argument("--no-prompt", action="store_true", help="send no prompt_token_ids in `open`")
    ap.add_argument("--keep-special", action="store_true", help="skip_special_tokens=false (default true)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="HF directory or GGUF file (default: the embedded SmolLM2-135M)")
    ap.add_argument("--engine-json", default=str(REPO / "results" / "engine_throughput.json"),
                    help="engine_throughput.py results to read the engine's output tokens/s from")
    ap.add_argument("--engine-tokens-per-s", type=float, default=None,
                    help="the engine's output tokens/s at 64 requests (overrides --engine-json)")
    ap.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for SERVING")
    ap.add_argument("--profile", action="store_true",
                    help="after the measurements, cProfile the session side and the in-process side once")
    ap.add_argument("--out", default=str(REPO / "results" / "detokenize_throughput.json"))
    args = ap.parse_args(argv)
    if args.no_stop:
        args.stop = []
    elif args.stop is None:
        args.stop = list(DEFAULT_STOPS)
    if args.requests < 1 or args.tokens < 2 or args.repeats < 1:
        ap.error("--requests >= 1, --tokens >= 2 and --repeats >= 1")
    return args


# -- workload ------------------------------------------------------------------------
class Workload:
    """The token sequences, the `open` specs and the prebuilt per-step messages."""

    def __init__(self, tokenizer: Tokenizer, args: argparse.Namespace) -> None:
        self.n, self.steps = args.requests, args.tokens
        self.stops = list(args.stop)
        self.skip = not args.keep_special
        eos = tokenizer.info.eos_token_ids[0] if tokenizer.info.eos_token_ids else None
        rng = random.Random(args.seed)
        self.request_ids = [f"cmpl-{rng.getrandbits(96):024x}-{rng.getrandbits(48):012x}#0" for _ in range(self.n)]
        self.sequences: list[list[int]] = []
        self.prompts: list[list[int]] = []
        body = self.steps - 1 if eos is not None else self.steps
        for r in range(self.n):
            order = PASSAGES[:]
            random.Random(args.seed * 7919 + r).shuffle(order)
            start = r % len(order)  # every passage opens some request
            order = order[start:] + order[:start]
            ids: list[int] = []
            text = ""
            while len(ids) < body:  # the corpus is ~5k tokens; loop only for huge --tokens
                text += ("\n\n" if text else "") + "\n\n".join(order)
                ids = tokenizer.encode(text, add_special_tokens=False).ids
            self.sequences.append(ids[:body] + ([eos] if eos is not None else []))
            if args.no_prompt:
                self.prompts.append([])
            else:
                question = f"Tell me about this, please: {order[-1][:160]}"
                if tokenizer.info.has_chat_template:
                    prompt = tokenizer.encode_chat([{"role": "user", "content": question}]).ids
                else:
                    prompt = tokenizer.encode(question).ids
                self.prompts.append(prompt)
        self.total_tokens = self.n * self.steps

        t0 = time.perf_counter()
        self.item_lists = self._build_items()
        self.messages = [tokenizer_pb2.DetokenizeStreamRequest(items=items) for items in self.item_lists]
        self.build_s = time.perf_counter() - t0

    def open_spec(self, r: int) -> tokenizer_pb2.DetokenizeOpen:
        return tokenizer_pb2.DetokenizeOpen(stop=self.stops, skip_special_tokens=self.skip,
                                            prompt_token_ids=self.prompts[r])

    def _build_items(self) -> list[list[tokenizer_pb2.DetokenizeItem]]:
        steps = []
        for s in range(self.steps):
            items = []
            for r in range(self.n):
                item = tokenizer_pb2.DetokenizeItem(request_id=self.request_ids[r],
                                                    new_token_ids=[self.sequences[r][s]],
                                                    finished=s == self.steps - 1)
                if s == 0:
                    item.open.CopyFrom(self.open_spec(r))
                items.append(item)
            steps.append(items)
        return steps

    def describe(self, tokenizer: Tokenizer, texts: list[str]) -> dict:
        chars = [len(t) for t in texts]
        non_ascii = sum(sum(1 for c in t if ord(c) > 127) for t in texts)
        partial = 0  # tokens that do not decode to whole characters alone
        for seq in self.sequences:
            partial += sum(1 for t in seq if "\ufffd" in tokenizer.decode([t], self.skip))
        return {
            "requests": self.n, "tokens_per_request": self.steps, "total_tokens": self.total_tokens,
            "text_chars_median": median(chars), "text_chars_total": sum(chars),
            "non_ascii_char_share": non_ascii / max(1, sum(chars)),
            "tokens_not_whole_chars_share": partial / self.total_tokens,
            "prompt_tokens_median": median(len(p) for p in self.prompts) if self.prompts else 0,
            "stop_strings": self.stops, "skip_special_tokens": self.skip,
            "passages": len(PASSAGES), "last_token_is_eos": self.sequences[0][-1] in tokenizer.info.eos_token_ids,
        }


# -- the sides -------------------------------------------------------------------------
def run_inprocess(tokenizer: Tokenizer, w: Workload) -> tuple[float, list[str]]:
    """IncrementalDetokenizer per request, step by step: (wall seconds, text per request)."""
    backend, seqs, n, last = tokenizer.backend, w.sequences, w.n, w.steps - 1
    pieces: list[list[str]] = [[] for _ in range(n)]
    t0 = time.perf_counter()
    dets = [IncrementalDetokenizer(backend, stop=w.stops, skip_special_tokens=w.skip,
                                   prompt_token_ids=w.prompts[r]) for r in range(n)]
    for s in range(w.steps):
        fin = s == last
        for r in range(n):
            pieces[r].append(dets[r].step((seqs[r][s],), finished=fin).text)
    wall = time.perf_counter() - t0
    return wall, ["".join(p) for p in pieces]


def run_session(tokenizer: Tokenizer, w: Workload) -> tuple[float, list]:
    """The server's DetokenizeSession on the prebuilt messages, no gRPC."""
    from tessera_tokenizer.server import DetokenizeSession

    t0 = time.perf_counter()
    session = DetokenizeSession(tokenizer)
    replies = [session.process(m) for m in w.messages]
    wall = time.perf_counter() - t0
    session.close()
    return wall, replies


async def run_service(stub, w: Workload, depth: int) -> tuple[float, list]:
    """One DetokenizeStream call, `depth` steps in flight (1 = lock-step)."""
    messages, n = w.messages, len(w.messages)
    call = stub.DetokenizeStream()
    replies = []
    await call.wait_for_connection()
    t0 = time.perf_counter()
    sent = 0
    while sent < min(depth, n):
        await call.write(messages[sent])
        sent += 1
    for _ in range(n):
        reply = await call.read()
        if reply is grpc.aio.EOF:
            raise RuntimeError(f"the service closed the stream after {len(replies)} replies")
        replies.append(reply)
        if sent < n:
            await call.write(messages[sent])
            sent += 1
    wall = time.perf_counter() - t0
    await call.done_writing()
    extra = await call.read()
    if extra is not grpc.aio.EOF:
        raise RuntimeError("the service sent more replies than messages")
    return wall, replies


async def run_frontend_client(client, w: Workload) -> tuple[float, list]:
    """Lock-step through the frontend's DetokenizeStream client (one stream, kept open)."""
    send = client.stream.send  # queues one message; a future of its results (counted by check_replies)
    t0 = time.perf_counter()
    replies = [await send(items) for items in w.item_lists]
    return time.perf_counter() - t0, replies


# -- checks --------------------------------------------------------------------------------
def check_replies(w: Workload, replies, expected: list[str], side: str) -> dict:
    """Deltas concatenate to the in-process text; every result as expected."""
    pieces: list[list[str]] = [[] for _ in range(w.n)]
    problems: list[str] = []
    if len(replies) != w.steps:
        problems.append(f"{len(replies)} replies for {w.steps} messages")
    for s, reply in enumerate(replies):
        results = reply.results if hasattr(reply, "results") else reply
        if len(results) != w.n:
            problems.append(f"step {s}: {len(results)} results for {w.n} items")
            continue
        for r, res in enumerate(results):
            if res.request_id != w.request_ids[r]:
                problems.append(f"step {s} item {r}: request_id {res.request_id!r} (order broken)")
            if res.HasField("error"):
                problems.append(f"step {s} {res.request_id}: error {res.error.code}: {res.error.message}")
            if res.HasField("stop_matched"):
                problems.append(f"step {s} {res.request_id}: stop_matched {res.stop_matched!r}")
            if res.tokens_consumed != 1:
                problems.append(f"step {s} {res.request_id}: tokens_consumed {res.tokens_consumed}")
            if res.finished != (s == w.steps - 1):
                problems.append(f"step {s} {res.request_id}: finished={res.finished}")
            pieces[r].append(res.text_delta)
    mismatched = []
    for r in range(w.n):
        got = "".join(pieces[r])
        if got != expected[r]:
            at = next((i for i, (a, b) in enumerate(zip(got, expected[r])) if a != b), min(len(got), len(expected[r])))
            mismatched.append(r)
            problems.append(f"request {r}: text differs from in-process at char {at}: "
                            f"{got[at:at + 30]!r} vs {expected[r][at:at + 30]!r}")
    return {"side": side, "ok": not problems, "mismatched_requests": len(mismatched),
            "problems": problems[:20], "problem_count": len(problems)}


# -- engine figure ---------------------------------------------------------------------------
def engine_figure(args: argparse.Namespace) -> tuple[float | None, str | None]:
    if args.engine_tokens_per_s:
        return args.engine_tokens_per_s, "--engine-tokens-per-s"
    path = pathlib.Path(args.engine_json)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None, None
    sc = data.get("scenarios", {})
    candidates = [
        ("scenarios.batch64.engine.tokens_per_s.median",
         lambda: sc["batch64"]["engine"]["tokens_per_s"]["median"]),
        ("scenarios.scale.tokens_per_s_by_level.64", lambda: sc["scale"]["tokens_per_s_by_level"]["64"]),
    ]
    for name, get in candidates:
        try:
            value = float(get())
        except (KeyError, TypeError, ValueError):
            continue
        if value > 0:
            return value, f"{path}:{name}"
    return None, None


def _cpu_s(proc) -> float:
    if proc is None:
        return float("nan")
    t = proc.cpu_times()
    return t.user + t.system


# -- measuring -------------------------------------------------------------------------------
async def open_frontend_client(addr: str):
    """The frontend's TokenizerClient with its DetokenizeStream connected, or None (logged) when it fails."""
    try:
        from tessera_frontend.tokenizer_client import TokenizerClient
        client = TokenizerClient(addr)
        client.stream.start()
        deadline = time.monotonic() + 30
        while not client.stream.connected:
            if time.monotonic() > deadline:
                raise RuntimeError("the frontend client's stream did not connect in 30 s")
            await asyncio.sleep(0.01)
        return client
    except Exception as exc:
        log(f"frontend client side skipped: {exc!r}")
        return None


async def measure(args: argparse.Namespace, tokenizer: Tokenizer, w: Workload, service: Service) -> dict:
    """Every side --warmup + --repeats times, in rotating order; {"sides": per-side figures, "checks": ...}."""
    try:
        import psutil
        me, server_proc = psutil.Process(), psutil.Process(service.process.pid)
    except Exception:  # psutil missing: no CPU figures
        me = server_proc = None

    channel = grpc.aio.insecure_channel(service.addr, options=CHANNEL_OPTIONS)
    stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
    client = None if args.no_frontend_client else await open_frontend_client(service.addr)

    expected: list[str] | None = None
    sides = ["inprocess"] + ([] if args.no_session else ["session"]) + ["service"]
    if args.pipeline_depth > 1:
        sides.append(f"service_pipe{args.pipeline_depth}")
    if client is not None:
        sides.append("frontend_client")
    runs: dict[str, list[dict]] = {s: [] for s in sides}
    checks: dict[str, dict] = {}

    async def one(side: str) -> tuple[float, object]:
        if side == "inprocess":
            return run_inprocess(tokenizer, w)
        if side == "session":
            return run_session(tokenizer, w)
        if side == "service":
            return await run_service(stub, w, 1)
        if side.startswith("service_pipe"):
            return await run_service(stub, w, args.pipeline_depth)
        return await run_frontend_client(client, w)

    try:
        for rep in range(-args.warmup, args.repeats):
            k = rep % len(sides)
            order = sides[k:] + sides[:k]
            if "inprocess" in order and expected is None:  # the reference first, once
                order.remove("inprocess")
                order.insert(0, "inprocess")
            for side in order:
                cpu_me0, cpu_srv0 = _cpu_s(me), _cpu_s(server_proc)
                wall, out = await one(side)
                cpu_me, cpu_srv = _cpu_s(me) - cpu_me0, _cpu_s(server_proc) - cpu_srv0
                if side == "inprocess":
                    if expected is None:
                        expected = out
                        checks["inprocess_vs_full_decode"] = check_full_decode(tokenizer, w, out)
                    elif out != expected:
                        raise RuntimeError("in-process detokenization is not deterministic")
                elif side not in checks or not checks[side]["ok"]:
                    checks[side] = check_replies(w, out, expected, side)
                if rep < 0:
                    log(f"[warmup] {side:16s} {w.total_tokens / wall:10.0f} tok/s")
                    continue
                rec = {"tokens_per_s": w.total_tokens / wall, "wall_s": wall, "client_cpu_s": cpu_me}
                if side not in ("inprocess", "session"):
                    rec["server_cpu_s"] = cpu_srv
                runs[side].append(rec)
                log(f"[{rep + 1}/{args.repeats}] {side:16s} {rec['tokens_per_s']:10.0f} tok/s  wall {wall:6.3f} s  "
                    f"cpu client {cpu_me:6.3f} s" + (f" server {cpu_srv:6.3f} s" if "server_cpu_s" in rec else ""))
    finally:
        if client is not None:
            await client.close()
        await channel.close()
    return {"sides": summarize_sides(runs, w.total_tokens), "checks": checks}


def summarize_sides(runs: dict[str, list[dict]], total_tokens: int) -> dict:
    """Per side: medians (tokens/s, wall, CPU), the ratio to the in-process side, tokens per CPU second."""
    sides_out = {}
    base = median(r["tokens_per_s"] for r in runs["inprocess"])
    for side, recs in runs.items():
        tps = summarize([r["tokens_per_s"] for r in recs])
        entry = {"tokens_per_s": tps, "ratio_vs_inprocess": tps["median"] / base,
                 "wall_s": summarize([r["wall_s"] for r in recs]),
                 "client_cpu_s": summarize([r["client_cpu_s"] for r in recs])}
        if "server_cpu_s" in recs[0]:
            entry["server_cpu_s"] = summarize([r["server_cpu_s"] for r in recs])
        # Tokens per CPU second of the process doing the detokenizing (the server for the
        # service sides, this process otherwise): far less sensitive to a busy machine
        # than wall time. psutil's CPU times tick in 10 ms.
        own_cpu = entry.get("server_cpu_s", entry["client_cpu_s"])["median"]
        entry["tokens_per_cpu_s"] = total_tokens / own_cpu if own_cpu > 0 else None
        if side != "inprocess":
            # paired: each repeat's side over the same repeat's in-process figure
            entry["paired_ratios"] = [r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(recs, runs["inprocess"])]
        sides_out[side] = entry
    cpu_base = sides_out["inprocess"].get("tokens_per_cpu_s")
    for e in sides_out.values():
        e["cpu_ratio_vs_inprocess"] = e["tokens_per_cpu_s"] / cpu_base if cpu_base and e["tokens_per_cpu_s"] else None
    return sides_out


def check_full_decode(tokenizer: Tokenizer, w: Workload, texts: list[str]) -> dict:
    bad = []
    for r in range(w.n):
        full = tokenizer.decode(w.sequences[r], w.skip)
        if texts[r] != full:
            at = next((i for i, (a, b) in enumerate(zip(texts[r], full)) if a != b), min(len(texts[r]), len(full)))
            bad.append(f"request {r}: char {at}: {texts[r][at:at + 30]!r} vs full decode {full[at:at + 30]!r}")
    for stop in w.stops:
        hits = sum(stop in t for t in texts)
        if hits:
            raise SystemExit(f"stop string {stop!r} occurs in {hits} request texts; pick one that never matches")
    return {"ok": not bad, "mismatched_requests": len(bad), "problems": bad[:20]}


def profile_sides(tokenizer: Tokenizer, w: Workload, top: int = 25) -> dict:
    out = {}
    for side, fn in (("session", run_session), ("inprocess", run_inprocess)):
        prof = cProfile.Profile()
        prof.enable()
        fn(tokenizer, w)
        prof.disable()
        buf = io.StringIO()
        stats = pstats.Stats(prof, stream=buf).sort_stats("tottime")
        stats.print_stats(top)
        out[side] = buf.getvalue()
        log(f"--- cProfile of the {side} side (by tottime) ---")
        log("\n".join(ln for ln in buf.getvalue().splitlines() if ln.strip())[:6000])
    return out


def run_benchmark(args: argparse.Namespace) -> dict:
    """Start the tokenizer service, build the workload in-process, measure every side, stop the service."""
    log_dir = pathlib.Path(tempfile.mkdtemp(prefix="tessera-detok-bench-"))
    service_args = ["--metrics-port", "0"] + (["--model", args.model] if args.model else [])
    service = Service("tokenizer", "tessera_tokenizer", free_port(), service_args, log_dir / "tokenizer.log")
    service.start()  # loads while this process loads its own copy
    try:
        t0 = time.perf_counter()
        tokenizer = Tokenizer.load(args.model)
        log(f"tokenizer {tokenizer.info.model_name} loaded in-process in {time.perf_counter() - t0:.1f} s")
        w = Workload(tokenizer, args)
        log(f"workload: {w.n} requests x {w.steps} tokens, {len(w.messages)} messages "
            f"(built in {w.build_s:.3f} s), stops {w.stops!r}")
        service.wait_serving(time.monotonic() + args.startup_timeout)
        log(f"service SERVING on {service.addr} (pid {service.process.pid}, log {service.log_path})")
        result = asyncio.run(measure(args, tokenizer, w, service))
        profile = profile_sides(tokenizer, w) if args.profile else None
        _, expected = run_inprocess(tokenizer, w)
        workload = w.describe(tokenizer, expected)
    finally:
        service.stop()
    return {**result, "workload": workload, "profile": profile, "w": w, "service_log": str(service.log_path)}


def print_report(args: argparse.Namespace, w: Workload, sides: dict, checks: dict,
                 engine_tps: float | None, engine_src: str | None, target: float | None) -> None:
    header = ("side", "tok/s median", "min", "max", "x in-proc", "srv cpu s", "cli cpu s", "tok/cpu-s", "x in-proc cpu")
    rows = []
    for side, e in sides.items():
        t = e["tokens_per_s"]
        rows.append((side, fmt(t["median"], ",.0f"), fmt(t["min"], ",.0f"), fmt(t["max"], ",.0f"),
                     fmt(e["ratio_vs_inprocess"], ".3f"),
                     fmt(e.get("server_cpu_s", {}).get("median"), ".3f"),
                     fmt(e["client_cpu_s"]["median"], ".3f"), fmt(e.get("tokens_per_cpu_s"), ",.0f"),
                     fmt(e.get("cpu_ratio_vs_inprocess"), ".3f")))
    print(f"DetokenizeStream throughput: {w.n} requests x {w.steps} tokens, one token per request per step, "
          f"medians of {args.repeats} (cores: {os.cpu_count()}, load {os.getloadavg()[0]:.2f})")
    for line in format_table(header, rows, rule_per_column=True):
        print(line)
    print("tok/s: 64 x 512 tokens / wall time; tok/cpu-s: per CPU second of the detokenizing process "
          "(server for service sides), the noise-robust figure on a shared machine")
    for name, c in checks.items():
        status = "OK" if c["ok"] else f"FAILED ({c.get('mismatched_requests', 0)} requests; " \
                                      f"{'; '.join(c['problems'][:3])})"
        print(f"check {name}: {status}")
    if engine_tps:
        print(f"engine output tokens/s (64 requests): {engine_tps:,.0f}  [{engine_src}]")
        print(f"target: service >= {TARGET_VS_ENGINE:g}x engine -> {target:.1f}x "
              f"({'met' if target >= TARGET_VS_ENGINE else 'MISSED'})")
        print(f"target_ratio_vs_engine={target:.2f}")
    else:
        print("engine output tokens/s unknown: run benchmarks/engine_throughput.py or pass --engine-tokens-per-s")


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    t_start = time.perf_counter()
    run = run_benchmark(args)
    w, sides, checks = run["w"], run["sides"], run["checks"]
    ratio = sides["service"]["tokens_per_s"]["median"] / sides["inprocess"]["tokens_per_s"]["median"]
    cpu_ratio = sides["service"]["cpu_ratio_vs_inprocess"]
    engine_tps, engine_src = engine_figure(args)
    target = sides["service"]["tokens_per_s"]["median"] / engine_tps if engine_tps else None
    print_report(args, w, sides, checks, engine_tps, engine_src, target)

    results = {
        "benchmark": "detokenize_throughput",
        "description": "DetokenizeStream: tokenizer service (own process, loopback gRPC) vs in-process "
                       "IncrementalDetokenizer; one message per engine step, one token per request per step",
        "config": {k: v for k, v in vars(args).items()},
        "environment": environment(packages=("grpc", "tokenizers")),
        "workload": run["workload"],
        "build_messages_s": w.build_s,
        "sides": sides,
        "checks": checks,
        "service_vs_inprocess": ratio,
        "service_vs_inprocess_cpu": cpu_ratio,
        "engine_tokens_per_s": engine_tps,
        "engine_tokens_per_s_source": engine_src,
        "target_ratio_vs_engine": target,
        "target": {"min_ratio_vs_engine": TARGET_VS_ENGINE,
                   "met": None if target is None else target >= TARGET_VS_ENGINE},
        "profile": run["profile"],
        "service_log": run["service_log"],
        "total_s": time.perf_counter() - t_start,
    }
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, ensure_ascii=False) + "\n")
    print(f"saved {out} (total {results['total_s']:.0f} s)")
    if cpu_ratio is not None:
        print(f"service_vs_inprocess_cpu={cpu_ratio:.3f}")
    print(f"service_vs_inprocess={ratio:.3f}")
    ok = all(c["ok"] for name, c in checks.items() if name != "inprocess_vs_full_decode")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""Gemma 3 through the tokenizer: the real google/gemma-3-270m Q4_K_M GGUF file (a base model's
file: no chat template in it), in process and as the service, and the three services on it.

- the vocabulary: ids equal llama.cpp's tokenization of the same file (recorded below from
  llama-cpp-python 0.3.36, and compared live where the benchmarks' llama-cpp venv exists) and
  transformers' `AutoTokenizer.from_pretrained(dir, gguf_file=...)`; one BOS;
- the facts: BOS 2, EOS 1 and `<end_of_turn>` 106 (a turn's end stops generation, as llama.cpp
  and the instruction-tuned models' generation_config have it), 262144 ids, 32768 context;
- the chat template: Gemma's built-in format, chosen at load because the file has none, rendering
  what llama-server's built-in `gemma` template renders (recorded below), refusing what Gemma's
  turns cannot express; `--chat-template` (a file or inline Jinja) replacing it.
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import time

import grpc
import pytest

from tessera import launch
from tessera.v1 import tokenizer_pb2 as pb
from tessera.v1 import tokenizer_pb2_grpc
from tessera_tokenizer import chat_formats, server
from tessera_tokenizer.detokenizer import IncrementalDecoder
from tessera_tokenizer.tokenizer import Tokenizer

from helpers.gemma3_file import gemma3_gguf
from helpers.stack import STARTUP_TIMEOUT_S, Service, free_port, serving

BOS, EOS, START_OF_TURN, END_OF_TURN = 2, 1, 105, 106

# llama.cpp's ids for these texts on the file (llama_tokenize with add_bos, parse_special).
LLAMA_CPP_IDS = {
    "Hello world": [2, 9259, 1902],
    "  two spaces": [2, 138, 13498, 9952],
    "trailing   ": [2, 136697, 139],
    "a\tb\n\nc": [2, 236746, 255968, 236763, 108, 236755],
    "日本語のテキスト 🎉 and émigré café":
        [2, 94951, 236945, 95830, 204906, 532, 1559, 32124, 11460, 33443],
    "def f(x):\n    return x**2  # square\n":
        [2, 2063, 517, 236769, 236781, 1473, 107, 140, 2060, 1123, 1018, 236778, 138, 236865, 6281, 107],
    "1234567890 3.14159 -42": [2, 236770, 236778, 236800, 236812, 236810, 236825, 236832, 236828, 236819, 236771,
                               236743, 236800, 236761, 236770, 236812, 236770, 236810, 236819, 753, 236812, 236778],
    "\u00a0nbsp\u00a0": [2, 432, 398, 11539, 432, 398],
    "multiple\r\nline\rendings": [2, 43819, 251, 107, 1257, 251, 643, 1013],
    "<unused0> <mask> <eos>": [2, 6, 236743, 4, 236743, 1],
    "ßẞ İı ﬁ": [2, 237435, 240589, 11732, 236955, 97940],
    "": [2],
}
# llama-server --chat-template gemma's /apply-template for these chats, and its /tokenize of the
# first (BOS added by the tokenizer there, written by the template here: the same ids).
LLAMA_SERVER_CHATS = [
    ([{"role": "user", "content": " Hi there \n"}],
     "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n"),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
      {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": " Why? "}],
     "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
     "<start_of_turn>user\nWhy?<end_of_turn>\n<start_of_turn>model\n"),
]
LLAMA_SERVER_CHAT_IDS = [2, 105, 2364, 107, 10979, 993, 106, 107, 105, 4368, 107]


@pytest.fixture(scope="module")
def gemma() -> Tokenizer:
    return Tokenizer.load(str(gemma3_gguf()))


# -- in process -----------------------------------------------------------------------------------
@pytest.mark.unit
def test_ids_equal_llama_cpp(gemma):
    for text, ids in LLAMA_CPP_IDS.items():
        assert gemma.encode(text).ids == ids, text
        assert gemma.decode(ids[1:], skip_special_tokens=False) == text, text


def _bench_llama_cpp_python() -> pathlib.Path | None:
    cache = pathlib.Path(os.environ.get("TESSERA_BENCH_CACHE", "~/.cache/tessera-bench")).expanduser()
    python = cache / "llama-cpp-venv" / "bin" / "python"
    return python if python.exists() else None


@pytest.mark.unit
def test_ids_equal_llama_cpp_live(gemma, tmp_path):
    """The same, and the chat prompts, against llama.cpp itself (the benchmarks' llama-cpp-python venv)."""
    python = _bench_llama_cpp_python()
    if python is None:
        pytest.skip("no llama-cpp-python venv in the benchmark cache (benchmarks/peers/llama_cpp_python.py makes it)")
    texts = list(LLAMA_CPP_IDS) + [gemma.render_chat(chat) for chat, _ in LLAMA_SERVER_CHATS]
    script = ("import json, sys\nfrom llama_cpp import Llama\n"
              "m = Llama(model_path=sys.argv[1], vocab_only=True, verbose=False)\n"
              "texts = json.load(sys.stdin)\n"
              "print(json.dumps([m.tokenize(t.encode(), add_bos=not t.startswith('<bos>'), special=True) "
              "for t in texts]))\n")
    done = subprocess.run([str(python), "-c", script, str(gemma3_gguf())], input=json.dumps(texts),
                          capture_output=True, text=True, timeout=120, check=True)
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    for text, ids in zip(texts, theirs):
        ours = gemma.encode(text, add_special_tokens=not text.startswith("<bos>")).ids
        assert ours == ids, text


@pytest.mark.unit
@pytest.mark.slow  # transformers' GGUF tokenizer load (torch imported, the header read): ~30 s
def test_vocabulary_and_ids_equal_transformers(gemma):
    from transformers import AutoTokenizer

    path = gemma3_gguf()
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert hf.get_vocab() == gemma.hf.get_vocab()
    assert (hf.bos_token_id, hf.eos_token_id) == (BOS, EOS)
    for text in LLAMA_CPP_IDS:
        ids = hf(text)["input_ids"]
        assert gemma.encode(text).ids == ids, text
        assert gemma.decode(ids) == hf.decode(ids, skip_special_tokens=True), text
        assert gemma.decode(ids, skip_special_tokens=False) == hf.decode(ids), text


@pytest.mark.unit
def test_incremental_decoding_equals_the_whole(gemma):
    """Token by token (Gemma spells spaces as U+2581 and falls back to bytes for rare characters),
    the deltas add up to the whole decode, and no delta holds a broken character."""
    text = "Gemma's ½ café — 日本語, emoji 🎉🧪, tabs\tand  two spaces.\n  indented ⟨x⟩ Ω≈ç√"
    prompt = gemma.encode_chat([{"role": "user", "content": "Say it."}]).ids
    ids = gemma.encode(text, add_special_tokens=False).ids + [END_OF_TURN]
    decoder = IncrementalDecoder(gemma.backend, prompt_token_ids=prompt)
    deltas = [decoder.step([token]) for token in ids] + [decoder.flush()]
    assert "".join(deltas) == gemma.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.unit
def test_hf_directory_of_the_same_tokenizer(gemma, tmp_path):
    """The tokenizer saved as an HF directory with a Gemma 3 config (no chat template in it, as a
    base model's): the same ids, the built-in template, the end of turn an EOS."""
    gemma.hf.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").unlink()  # ours, saved with it
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert "chat_template" not in config
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3_text", "max_position_embeddings": 32768}))
    tok = Tokenizer.load(str(tmp_path))
    assert tok.chat_template_source == "built-in gemma (the model's files have none)"
    assert (tok.info.bos_token_id, tok.info.eos_token_ids, tok.info.max_model_len) == (BOS, (EOS, END_OF_TURN), 32768)
    for text, ids in LLAMA_CPP_IDS.items():
        assert tok.encode(text).ids == ids, text
    assert tok.encode_chat(LLAMA_SERVER_CHATS[0][0]).ids == LLAMA_SERVER_CHAT_IDS


@pytest.mark.unit
def test_model_info(gemma):
    info = gemma.info
    assert info.model_name == "gemma-3-270m-q4_k_m"
    assert info.vocab_size == 262144
    assert info.bos_token_id == BOS
    assert info.eos_token_ids == (EOS, END_OF_TURN)
    assert info.max_model_len == 32768
    assert info.has_chat_template
    assert gemma.chat_template_source == "built-in gemma (the model's files have none)"
    assert {"<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"} <= set(info.special_tokens)
    assert gemma.decode([BOS, 9259, 1902, END_OF_TURN, EOS]) == "Hello world"


@pytest.mark.unit
def test_chat_template_renders_as_llama_server(gemma):
    for chat, text in LLAMA_SERVER_CHATS:
        assert gemma.render_chat(chat) == "<bos>" + text
    assert gemma.encode_chat(LLAMA_SERVER_CHATS[0][0]).ids == LLAMA_SERVER_CHAT_IDS


@pytest.mark.unit
def test_chat_template_turns(gemma):
    # no generation prompt: the conversation as it is
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    assert gemma.render_chat(chat, add_generation_prompt=False) == (
        "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n")
    # a system message alone is still said (as a user turn), not dropped
    assert gemma.render_chat([{"role": "system", "content": " Answer in French. "}]) == (
        "<bos><start_of_turn>user\nAnswer in French.<end_of_turn>\n<start_of_turn>model\n")
    # a tool's result is a user turn; the assistant's call is written into its content
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
    rendered = gemma.render_chat([{"role": "user", "content": "Weather?"},
                                  {"role": "assistant", "content": "", "tool_calls": [call]},
                                  {"role": "tool", "tool_call_id": "c1", "content": "sunny"}])
    assert rendered.endswith('<start_of_turn>model\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n'
                             "</tool_call><end_of_turn>\n<start_of_turn>user\nsunny<end_of_turn>\n"
                             "<start_of_turn>model\n")
    # OpenAI's content parts: the text parts, in order
    parts = [{"type": "text", "text": "one "}, {"type": "image_url", "image_url": {"url": "x"}},
             {"type": "text", "text": "two"}]
    assert gemma.render_chat([{"role": "user", "content": parts}]) == (
        "<bos><start_of_turn>user\none two<end_of_turn>\n<start_of_turn>model\n")


@pytest.mark.unit
@pytest.mark.parametrize("chat, error", [
    ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
     "messages[1]: Gemma's turns must alternate user and assistant"),
    ([{"role": "assistant", "content": "a"}], "messages[0]: Gemma's turns must alternate"),
    ([{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}], "messages[1]: Gemma's turns"),
    ([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}], "messages[1]: role system is not allowed"),
])
def test_chat_template_refuses(gemma, chat, error):
    with pytest.raises(ValueError, match=r"chat template failed: " + error.replace("[", r"\[").replace("]", r"\]")):
        gemma.render_chat(chat)


@pytest.mark.unit
def test_chat_template_flag_replaces_the_template(tmp_path):
    file = tmp_path / "template.jinja"
    file.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
    inline = "{{ bos_token }}{{ messages[-1].content }}!"
    assert chat_formats.read_chat_template(inline) == (inline, "--chat-template (inline)")
    assert chat_formats.read_chat_template(str(file)) == (file.read_text(), f"--chat-template {file}")
    tok = Tokenizer.load(None, str(file))
    assert tok.chat_template_source == f"--chat-template {file}"
    assert tok.info.has_chat_template
    assert tok.render_chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
                           add_generation_prompt=False) == "[user] hi\n[assistant] yo\n"


@pytest.mark.unit
def test_chat_template_flag_over_gemma():
    tok = Tokenizer.load(str(gemma3_gguf()), "{{ bos_token }}Q: {{ messages[0].content }}\nA:")
    assert tok.render_chat([{"role": "user", "content": "hi"}]) == "<bos>Q: hi\nA:"
    assert tok.info.eos_token_ids == (EOS, END_OF_TURN)  # the family's end of turn stays an EOS


@pytest.mark.unit
@pytest.mark.parametrize("value, error", [
    ("/no/such/template.jinja", "--chat-template: '/no/such/template.jinja' is neither a readable file nor an "
                                "inline Jinja template"),
    ("{% for m in messages %}", "--chat-template: not a valid Jinja template: line 1"),
])
def test_chat_template_flag_refused(value, error, capsys):
    with pytest.raises(ValueError, match=error.replace("(", r"\(")):
        chat_formats.read_chat_template(value)
    with pytest.raises(SystemExit) as exc:  # the service: a usage error before it starts
        server.parse_args(["--chat-template", value])
    assert exc.value.code == 2
    assert error in capsys.readouterr().err


@pytest.mark.unit
def test_default_model_keeps_its_own_template():
    tok = Tokenizer.load(None)
    assert tok.chat_template_source == "the model's"
    assert tok.info.eos_token_ids == (2,)
    assert chat_formats.chat_format("llama") is None
    assert chat_formats.chat_format("gemma3") is chat_formats.chat_format("gemma3_text") is chat_formats.GEMMA


# -- the service process --------------------------------------------------------------------------
@pytest.mark.integration
def test_service_on_gemma(tmp_path):
    path = str(gemma3_gguf())
    service = Service("tokenizer", "tessera_tokenizer", free_port(), ["--model", path], tmp_path / "tokenizer.log")
    with serving(service) as channel:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        info = stub.GetModelInfo(pb.ModelInfoRequest(), timeout=10)
        assert (info.vocab_size, info.bos_token_id, list(info.eos_token_ids)) == (262144, BOS, [EOS, END_OF_TURN])
        assert info.has_chat_template and info.max_model_len == 32768
        chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=" Hi there \n")])
        reply = stub.Tokenize(pb.TokenizeRequest(chat=chat), timeout=10)
        assert list(reply.token_ids) == LLAMA_SERVER_CHAT_IDS
        refused = [pb.ChatMessage(role="user", content="a"), pb.ChatMessage(role="user", content="b")]
        with pytest.raises(grpc.RpcError) as exc:
            stub.Tokenize(pb.TokenizeRequest(chat=pb.ChatMessages(messages=refused)), timeout=10)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "messages[1]: Gemma's turns must alternate" in exc.value.details()
        text = stub.Detokenize(pb.DetokenizeRequest(token_ids=LLAMA_CPP_IDS["Hello world"]), timeout=10).text
        assert text == "Hello world"
    loaded = [json.loads(line) for line in service.log_path.read_text().splitlines()
              if '"tokenizer loaded"' in line]
    assert loaded and loaded[0]["chat_template"] == "built-in gemma (the model's files have none)"
    assert loaded[0]["eos_token_ids"] == [EOS, END_OF_TURN]


@pytest.mark.integration
def test_service_chat_template_flag(tmp_path):
    service = Service("tokenizer", "tessera_tokenizer", free_port(),
                      ["--chat-template", "{% for m in messages %}{{ m.content }}|{% endfor %}"],
                      tmp_path / "tokenizer.log")
    with serving(service) as channel:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="a"),
                                         pb.ChatMessage(role="assistant", content="b")])
        reply = stub.Tokenize(pb.TokenizeRequest(chat=chat), timeout=10)
        assert reply.text == "a|b|"
        assert stub.Detokenize(pb.DetokenizeRequest(token_ids=reply.token_ids), timeout=10).text == "a|b|"


# -- the three services -----------------------------------------------------------------------------
@pytest.mark.integration
@pytest.mark.slow
def test_stack_streams_a_gemma_chat(tmp_path):
    """tokenizer, engine and frontend on the Gemma file: a streamed chat request through the OpenAI API,
    its prompt the Gemma template's tokens, its stream equal to the same request answered whole."""
    import openai

    path = str(gemma3_gguf())
    stack = launch.Stack(tmp_path, tokenizer_args=["--model", path], engine_args=["--model", path],
                         service_class=Service)
    stack.start(STARTUP_TIMEOUT_S)  # a failure shows the tail of the failing service's log
    try:
        client = openai.OpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0, timeout=300)
        model = client.models.list().data[0].id
        messages = [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "What is the sky's colour?"}]
        prompt_ids = Tokenizer.load(path).encode_chat(messages).ids
        body = dict(model=model, messages=messages, max_tokens=16, temperature=0,
                    extra_body={"ignore_eos": True})
        started = time.monotonic()
        chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **body))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = chunks[-1].usage
        assert usage.prompt_tokens == len(prompt_ids)
        assert usage.completion_tokens == 16
        assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 2  # streamed, not one lump
        whole = client.chat.completions.create(**body)
        assert whole.choices[0].message.content == streamed
        assert time.monotonic() - started < 120
    finally:
        stack.stop()

"""The model's tokenizer: text and chat messages to token ids, ids back to text, model facts.

Loads either a Hugging Face model directory (tokenizer.json / tokenizer_config.json) or
the tokenizer embedded in a GGUF file. All encoding and decoding goes through the fast
Rust `tokenizers.Tokenizer` (`Tokenizer.backend`); the transformers wrapper is kept
only to render chat templates the way transformers does.

Nothing here imports torch: transformers' own GGUF loader does (in transformers 5), so
GGUF metadata is read by `gguf_metadata` and the vocabulary is converted with transformers'
torch-free `convert_gguf_tokenizer`.

The chat template is chosen once, at load (`Tokenizer.chat_template_source` says which):
`--chat-template` when given, else the model's own, else its family's built-in format
(`chat_formats`: Gemma's, for a base model's file that carries none), else none. A family's
end-of-turn token (Gemma's `<end_of_turn>`) joins the EOS ids, as llama.cpp does.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any, Iterable, Mapping, Sequence

import tokenizers

from tessera.common.model_source import ModelSource, resolve_model
from tessera_tokenizer.chat_formats import chat_format, read_chat_template
from tessera_tokenizer.gguf_metadata import read_metadata

# Inputs longer than this go through the batch calls of `tokenizers`, which release the
# GIL while they run (the single-input calls hold it), so other threads keep running.
_GIL_FREE_CHARS = 4096
_GIL_FREE_TOKENS = 2048

# A max length above this is a "no limit" placeholder, not a real context size
# (transformers uses 1e30 when a tokenizer config names none).
_SANE_MAX_LEN = 1 << 24


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """Facts about the model that clients of the tokenizer need."""

    model_name: str
    vocab_size: int                 # token ids are valid in [0, vocab_size)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]  # every id that ends generation, tokenizer's EOS first
    max_model_len: int              # context length; 0 when unknown
    has_chat_template: bool
    special_tokens: tuple[str, ...]  # what skip_special_tokens removes, by id


@dataclasses.dataclass
class Encoding:
    """The result of tokenizing: ids, optional (start, end) char offsets, and the text."""

    ids: list[int]
    offsets: list[tuple[int, int]] | None
    text: str


class Tokenizer:
    """One loaded tokenizer. Thread-safe for encode/decode (the Rust tokenizer is)."""

    def __init__(self, hf_tokenizer: Any, info: ModelInfo, chat_template_source: str = "") -> None:
        self.hf = hf_tokenizer
        self.backend: tokenizers.Tokenizer = hf_tokenizer.backend_tokenizer
        self.info = info
        self.chat_template_source = chat_template_source or ("the model's" if info.has_chat_template else "none")

    @classmethod
    def load(cls, model: str | None = None, chat_template: str | None = None) -> "Tokenizer":
        """Load from a --model value: None/"" (the embedded default), a .gguf file or an HF directory.

        `chat_template`: --chat-template's value (a file, or Jinja inline), which replaces the
        model's template. ValueError when it is neither a readable file nor a valid template.
        """
        override = read_chat_template(chat_template) if chat_template else None
        source = resolve_model(model)
        if source.gguf_file:
            hf, meta = _load_gguf(source.path)
            architecture = meta.get("general.architecture")
            max_len = _int_or_none(meta.get(f"{architecture}.context_length"))
            extra_eos = [meta.get(f"tokenizer.ggml.{k}") for k in ("eos_token_id", "eot_token_id", "eom_token_id")]
        else:
            hf = _load_hf_dir(source.directory)
            architecture = _hf_architecture(source.directory)
            max_len, extra_eos = _read_hf_config(source.directory)
        family = chat_format(architecture)
        if family is not None:
            extra_eos.append(hf.backend_tokenizer.token_to_id(family.end_of_turn))
        template_source = ""
        if override is not None:
            hf.chat_template, template_source = override
        elif not getattr(hf, "chat_template", None) and family is not None:
            hf.chat_template = family.template
            template_source = f"built-in {family.name} (the model's files have none)"
        return cls(hf, _model_info(source, hf, max_len, extra_eos), template_source)

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True, return_offsets: bool = False) -> Encoding:
        """Tokenize plain text; special tokens (e.g. BOS) as the tokenizer's config says."""
        if len(text) > _GIL_FREE_CHARS:
            (enc,) = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)
        else:
            enc = self.backend.encode(text, add_special_tokens=add_special_tokens)
        return Encoding(enc.ids, list(enc.offsets) if return_offsets else None, text)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The prompt text for chat `messages` per the model's template.

        A message is {"role", "content"}, an assistant one may have OpenAI's "tool_calls" and a
        tool one "tool_call_id"; `tools` is OpenAI's tools list. A template that does not mention
        tools gets them in a system message, and one that does not render tool calls gets them
        written into the assistant's content (`_tools_for_template`).

        Raises ValueError when the model has no chat template or the template rejects the messages.
        """
        if not self.info.has_chat_template:
            raise ValueError("the model has no chat template")
        try:
            template = self.hf.get_chat_template(tools=list(tools) if tools else None)
            conversation, tools = _tools_for_template(template, messages, tools)
            return self.hf.apply_chat_template(
                conversation, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as exc:  # jinja2 TemplateError, raise_exception() in templates, ...
            raise ValueError(f"chat template failed: {exc}") from exc

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        return_offsets: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> Encoding:
        """Render chat messages (and tools) with the template, then tokenize the result.

        The template writes any BOS itself, so no special tokens are added (as transformers does).
        """
        text = self.render_chat(messages, add_generation_prompt, tools)
        return self.encode(text, add_special_tokens=False, return_offsets=return_offsets)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Token ids to text. Incomplete UTF-8 at the end (or anywhere) becomes U+FFFD."""
        if len(ids) > _GIL_FREE_TOKENS:
            return self.backend.decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)[0]
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def first_invalid_id(self, ids: Iterable[int]) -> int | None:
        """The first id outside [0, vocab_size), or None when all are valid."""
        size = self.info.vocab_size
        for token_id in ids:
            if not 0 <= token_id < size:
                return token_id
        return None


# Shows the tools to a model whose chat template does not mention them (OpenAI's tools list, one
# tool a line), in our own words; the <tool_call> format asked for is the Hermes-style one the
# frontend's parser reads.
TOOLS_SYSTEM_PROMPT = """# Tools

These functions are available to you. Each is described by one JSON line inside <tools></tools>:
<tools>
{tools}
</tools>

To use a function, answer with its name and a JSON object of its arguments inside <tool_call></tool_call>, one block per call:
<tool_call>
{{"name": "<function name>", "arguments": {{<arguments>}}}}
</tool_call>"""


def _tools_for_template(template: str, messages: Sequence[Mapping[str, Any]],
                        tools: Sequence[Mapping[str, Any]] | None
                        ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The conversation and tools to render with `template`: what it cannot render itself is
    written into the messages (the tools into a system message, tool calls into the content);
    tool-call arguments become objects, as templates expect (OpenAI sends them as JSON text)."""
    conversation = [dict(m) for m in messages]
    tools = [dict(t) for t in tools] if tools else None
    if tools and "tools" not in template:
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        prompt = TOOLS_SYSTEM_PROMPT.format(tools=listed)
        if conversation and conversation[0].get("role") == "system":
            first = conversation[0]
            first["content"] = f"{first['content']}\n\n{prompt}" if first.get("content") else prompt
        else:
            conversation.insert(0, {"role": "system", "content": prompt})
        tools = None
    renders_calls = "tool_calls" in template
    for message in conversation:
        calls = message.get("tool_calls")
        if not calls:
            message.pop("tool_calls", None)
            continue
        calls = [_call_for_template(c) for c in calls]
        if renders_calls:
            message["tool_calls"] = calls
            continue
        del message["tool_calls"]
        blocks = "\n".join("<tool_call>\n" + json.dumps({"name": c["function"].get("name"),
                                                          "arguments": c["function"].get("arguments")},
                                                         ensure_ascii=False) + "\n</tool_call>" for c in calls)
        content = message.get("content") or ""
        message["content"] = f"{content}\n{blocks}" if content else blocks
    return conversation, tools


def _call_for_template(call: Mapping[str, Any]) -> dict[str, Any]:
    """One OpenAI tool call with its arguments as an object where they are JSON text of one."""
    call = dict(call)
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments)
        except ValueError:
            pass  # not JSON: the template gets the text as it is
    call["function"] = function
    return call


def _load_hf_dir(directory: pathlib.Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


def _load_gguf(path: pathlib.Path) -> tuple[Any, dict[str, Any]]:
    """The transformers tokenizer for a GGUF file, and the file's metadata (scalars and strings)."""
    from transformers import TokenizersBackend
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    meta = read_metadata(path)

    def group(name: str) -> dict[str, Any]:
        keys = GGUF_TOKENIZER_MAPPING[name].items()
        return {new: meta[f"tokenizer.{old}"] for old, new in keys if f"tokenizer.{old}" in meta}

    tokenizer_dict, config = group("tokenizer"), group("tokenizer_config")
    if tokenizer_dict.get("tokenizer_type") == "llama":
        # llama.cpp adds BOS to a sentencepiece vocabulary unless the file says otherwise.
        config.setdefault("add_bos_token", True)
    tokens = tokenizer_dict["tokens"]
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        token_id = meta.get(f"tokenizer.ggml.{key}")
        config[name] = tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None
    backend, extra = convert_gguf_tokenizer(meta["general.architecture"], tokenizer_dict)
    config.update(extra)
    hf = TokenizersBackend(tokenizer_object=backend, **config)
    # Keep only small values: the token and merge lists are large and no longer needed.
    small = {k: v for k, v in meta.items() if not isinstance(v, list)}
    return hf, small


def _hf_architecture(directory: pathlib.Path) -> str | None:
    """config.json's model_type (a multimodal model's text_config's when it has a built-in chat format)."""
    config = _read_json(directory / "config.json")
    model_type = config.get("model_type")
    text_type = (config.get("text_config") or {}).get("model_type")
    return model_type if chat_format(model_type) or not text_type else text_type


def _read_hf_config(directory: pathlib.Path) -> tuple[int | None, list[Any]]:
    """(max_position_embeddings, eos ids) from config.json and generation_config.json."""
    config = _read_json(directory / "config.json")
    text_config = config.get("text_config") or {}
    max_len = None
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        max_len = _int_or_none(config.get(key, text_config.get(key)))
        if max_len:
            break
    eos = [config.get("eos_token_id"), text_config.get("eos_token_id"),
           _read_json(directory / "generation_config.json").get("eos_token_id")]
    return max_len, eos


def _read_json(path: pathlib.Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _model_info(source: ModelSource, hf: Any, max_len: int | None, extra_eos: list[Any]) -> ModelInfo:
    backend: tokenizers.Tokenizer = hf.backend_tokenizer
    added = backend.get_added_tokens_decoder()
    vocab_size = max([backend.get_vocab_size(with_added_tokens=True), *(i + 1 for i in added)])

    eos: list[int] = []
    for value in [hf.eos_token_id, *extra_eos]:
        for token_id in value if isinstance(value, (list, tuple)) else [value]:
            token_id = _int_or_none(token_id)
            if token_id is not None and 0 <= token_id < vocab_size and token_id not in eos:
                eos.append(token_id)

    if not max_len:
        model_max = _int_or_none(getattr(hf, "model_max_length", None))
        max_len = model_max if model_max and model_max < _SANE_MAX_LEN else 0

    special = {i: t.content for i, t in added.items() if t.special}
    for token in hf.all_special_tokens:
        token_id = backend.token_to_id(token)
        if token_id is not None:
            special.setdefault(token_id, token)

    return ModelInfo(
        model_name=source.name,
        vocab_size=vocab_size,
        bos_token_id=_int_or_none(hf.bos_token_id),
        eos_token_ids=tuple(eos),
        max_model_len=int(max_len),
        has_chat_template=bool(getattr(hf, "chat_template", None)),
        special_tokens=tuple(special[i] for i in sorted(special)),
    )


def _int_or_none(value: Any) -> int | None:
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None

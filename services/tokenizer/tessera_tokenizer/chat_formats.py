"""A model family's chat format where the model's files carry none, and `--chat-template`'s value.

A GGUF file converted from a base model (google/gemma-3-270m) has no
`tokenizer.chat_template`, yet the family has one documented turn format, which llama.cpp also
builds in (`--chat-template gemma`). For such a family this module gives that format as a
Jinja template and the token that ends a turn (an end-of-generation id besides the EOS, as
llama.cpp and the instruction-tuned models' generation_config treat it).

`read_chat_template` turns a `--chat-template` value (as vLLM's flag: a file, or the template
inline) into the template's text.
"""
from __future__ import annotations

import dataclasses
import pathlib

import jinja2


@dataclasses.dataclass(frozen=True)
class ChatFormat:
    """A family's turn format: its name (for logs), the Jinja template, the token ending a turn."""

    name: str
    template: str
    end_of_turn: str


# Gemma (1, 2 and 3) turns: `<start_of_turn>user|model\n` + the content, trimmed, +
# `<end_of_turn>\n`, after one `<bos>`. Gemma has no system turn: a first system message's text
# and a blank line open the first user turn. A tool's result is a user turn (Gemma has no tool
# role either). Turns must alternate user / model, starting with user, as Google's own template
# requires; anything else is refused with the message's index, not rendered into a prompt the
# model never saw in training.
GEMMA_TEMPLATE = """\
{%- macro text(content) -%}
  {%- if content is string -%}{{ content }}
  {%- elif content is iterable and content is not mapping -%}
    {%- for part in content if part.type == 'text' -%}{{ part.text }}{%- endfor -%}
  {%- endif -%}
{%- endmacro -%}
{{- bos_token -}}
{%- set ns = namespace(prefix='', first=0) -%}
{%- if messages and messages[0].role == 'system' -%}
  {%- set ns.prefix = text(messages[0].content) ~ '\\n\\n' -%}
  {%- set ns.first = 1 -%}
  {%- if messages | length == 1 -%}
    {{- '<start_of_turn>user\\n' ~ (text(messages[0].content) | trim) ~ '<end_of_turn>\\n' -}}
  {%- endif -%}
{%- endif -%}
{%- for message in messages[ns.first:] -%}
  {%- set index = loop.index0 + ns.first -%}
  {%- if message.role == 'assistant' -%}{%- set role = 'model' -%}
  {%- elif message.role in ('user', 'tool') -%}{%- set role = 'user' -%}
  {%- else -%}
    {{- raise_exception('messages[' ~ index ~ ']: role ' ~ message.role ~ ' is not allowed here: Gemma has '
                        ~ 'no system turn, only a first system message is folded into the first user turn') -}}
  {%- endif -%}
  {%- if (role == 'user') != (loop.index0 % 2 == 0) -%}
    {{- raise_exception('messages[' ~ index ~ ']: Gemma\\'s turns must alternate user and assistant, starting '
                        ~ 'with user (after an optional system message); this ' ~ message.role
                        ~ ' message breaks that') -}}
  {%- endif -%}
  {{- '<start_of_turn>' ~ role ~ '\\n' ~ (ns.prefix if loop.first else '') ~ (text(message.content) | trim)
      ~ '<end_of_turn>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}
"""

GEMMA = ChatFormat("gemma", GEMMA_TEMPLATE, "<end_of_turn>")

# By GGUF `general.architecture` or HF config `model_type` (a multimodal config's text_config too).
_BY_ARCHITECTURE = {
    "gemma": GEMMA,
    "gemma2": GEMMA,
    "gemma3": GEMMA,
    "gemma3_text": GEMMA,
}


def chat_format(architecture: str | None) -> ChatFormat | None:
    """The built-in chat format of this architecture, or None when there is none."""
    return _BY_ARCHITECTURE.get(architecture or "")


# A value holding any of these is a template itself, not a path (as vLLM decides).
_TEMPLATE_MARKS = ("{{", "{%", "\n")


def read_chat_template(value: str) -> tuple[str, str]:
    """(the template, where it came from) for a `--chat-template` value: a file's text, or the
    value itself when it is Jinja inline. Raises ValueError naming the flag when the value is
    neither a readable file nor a template, or when the template does not parse."""
    if any(mark in value for mark in _TEMPLATE_MARKS):
        template, source = value, "--chat-template (inline)"
    else:
        path = pathlib.Path(value).expanduser()
        try:
            template = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--chat-template: {value!r} is neither a readable file nor an inline Jinja "
                             f"template ({exc.strerror if isinstance(exc, OSError) else exc})") from None
        source = f"--chat-template {path}"
    check_template(template, "--chat-template")
    return template, source


def check_template(template: str, what: str) -> None:
    """Raise ValueError (naming `what` and the line) when `template` is not valid Jinja."""
    try:
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"{what}: not a valid Jinja template: line {exc.lineno}: {exc.message}") from None

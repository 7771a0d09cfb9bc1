"""Chat templates: load a model's Jinja template and render it the way HF transformers does.

The environment mirrors transformers' `_compile_jinja_template`: a sandbox with
trim_blocks/lstrip_blocks, `loopcontrols`, the `{% generation %}` tag, a `tojson` filter
that does not escape HTML, and the globals `raise_exception` and `strftime_now`; the
template sees `messages`, `tools`, `documents`, `add_generation_prompt` and the special
tokens. The gateway imports this module, so it must not import torch or transformers.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """A model directory has no chat template, or a template refused the conversation."""


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` renders its body unchanged.

    transformers uses the tag to find assistant tokens for training masks; serving needs
    only the text.
    """

    tags = frozenset({"generation"})

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML; chat templates want plain JSON.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile(chat_template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(chat_template)


def render_chat(
    chat_template: str,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    **special_tokens: Any,
) -> str:
    """The prompt text for `messages`, e.g. render_chat(t, msgs, bos_token="<s>"); `tools`
    are OpenAI tool definitions; any other keyword is a template variable too.

    A template's own `raise_exception(...)` (e.g. "roles must alternate") becomes a
    ChatTemplateError carrying its message.
    """
    try:
        return _compile(chat_template).render(
            messages=messages,
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **special_tokens,
        )
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(str(e)) from e


def load_chat_template(model_dir: Path) -> str:
    """The chat template of an HF-layout model directory.

    Looked up as transformers does: `chat_template.jinja` if present, else the
    `chat_template` of tokenizer_config.json (a string, or a list of named templates of
    which we take "default").
    """
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    config = _tokenizer_config(model_dir)
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default")
    if not isinstance(template, str):
        raise ChatTemplateError(f"{model_dir} has no chat template")
    return template


def load_special_tokens(model_dir: Path) -> dict[str, str]:
    """bos_token, eos_token, unk_token, pad_token (those present) for `render_chat`."""
    config = _tokenizer_config(model_dir)
    tokens: dict[str, str] = {}
    for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = config.get(key)
        # Older files write a token as {"content": "<s>", "lstrip": false, ...}.
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            tokens[key] = value
    return tokens


def _tokenizer_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "tokenizer_config.json"
    if not path.is_file():
        raise ChatTemplateError(f"{model_dir} has no tokenizer_config.json")
    return json.loads(path.read_text(encoding="utf-8"))

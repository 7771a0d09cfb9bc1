"""Chat template rendering and loading, checked against hand-written prompts and transformers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shared.models.chat_template import (
    ChatTemplateError,
    load_chat_template,
    load_special_tokens,
    render_chat,
)

# SmolLM2-135M-Instruct's template, as stored in its GGUF file.
SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Uses what HF templates rely on: bos_token, whitespace control by trim/lstrip_blocks,
# tojson without HTML escaping, loop controls, raise_exception and {% generation %}.
FEATURES = """{{ bos_token }}
{% for m in messages %}
    {% if m.role not in ['user', 'assistant'] %}
        {{ raise_exception('bad role: ' + m.role) }}
    {% endif %}
    {% if m.role == 'assistant' %}
[A]{% generation %}{{ m.content }}{% endgeneration %}{{ eos_token }}
    {% else %}
[U]{{ m.content | tojson }}
    {% endif %}
    {% if loop.index == 3 %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}[A]{% endif %}"""

CHAT = [
    {"role": "user", "content": "What is <b>2+2</b>?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "Merci, ça va ?"},
    {"role": "assistant", "content": "never rendered"},
]


def test_smollm2_prompt() -> None:
    question = [{"role": "user", "content": "What is the capital of France?"}]
    assert render_chat(SMOLLM2, question) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    with_system = [{"role": "system", "content": "Be brief."}, *question]
    assert render_chat(SMOLLM2, with_system, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    )


def test_features_hf_templates_use() -> None:
    rendered = render_chat(FEATURES, CHAT, bos_token="<s>", eos_token="</s>")
    # trim_blocks eats the newline after a {% tag %} only, so one stays after {{ bos_token }}.
    assert rendered == '<s>\n[U]"What is <b>2+2</b>?"\n[A]4.</s>\n[U]"Merci, ça va ?"\n[A]'


def test_raise_exception_becomes_chat_template_error() -> None:
    with pytest.raises(ChatTemplateError, match="bad role: tool"):
        render_chat(FEATURES, [{"role": "tool", "content": "x"}], bos_token="", eos_token="")


@pytest.mark.parametrize("template", [SMOLLM2, FEATURES])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_same_text_as_transformers(template: str, add_generation_prompt: bool) -> None:
    chat_template_utils = pytest.importorskip("transformers.utils.chat_template_utils")
    tokens = {"bos_token": "<s>", "eos_token": "</s>"}
    messages = CHAT[:3]
    (expected,), _ = chat_template_utils.render_jinja_template(
        [messages],
        chat_template=template,
        add_generation_prompt=add_generation_prompt,
        **tokens,
    )
    assert render_chat(template, messages, add_generation_prompt, **tokens) == expected


def test_load_from_tokenizer_config(tmp_path: Path) -> None:
    config = {"chat_template": SMOLLM2, "bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_chat_template(tmp_path) == SMOLLM2
    assert load_special_tokens(tmp_path) == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}


def test_load_prefers_jinja_file_and_reads_named_templates(tmp_path: Path) -> None:
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    assert load_chat_template(tmp_path) == "D"
    (tmp_path / "chat_template.jinja").write_text("J")
    assert load_chat_template(tmp_path) == "J"


def test_missing_template_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ChatTemplateError, match=r"no tokenizer_config\.json"):
        load_chat_template(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ChatTemplateError, match="no chat template"):
        load_chat_template(tmp_path)


def test_module_does_not_import_torch() -> None:
    code = "import sys, shared.models.chat_template; print('torch' in sys.modules)"
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"

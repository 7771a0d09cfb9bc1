"""The HF tokenizer files (tokenizer.json, tokenizer_config.json) of a GGUF model.

We build tokenizer.json ourselves with the `tokenizers` library rather than through
transformers' GGUF converter, which picks the wrong pre-tokenizer for some models. Only
byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`) are handled. The GGUF
`tokenizer.ggml.pre` value names the pre-tokenizer split; each one we know is mapped to the
exact pipeline of the model's original tokenizer.json.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gguf import GGUFReader, TokenType
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

from shared.models.gguf_metadata import GGUFConvertError, field

# Split regexes of the original tokenizer.json files (Qwen2 splits digits one by one,
# Llama 3 in runs of up to three).
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = _QWEN2_SPLIT.replace(r"|\p{N}|", r"|\p{N}{1,3}|")


@dataclass(frozen=True, slots=True)
class GGUFVocab:
    """The tokenizer part of a GGUF file's metadata."""

    tokens: tuple[str, ...]  # id -> token text, byte-level encoded (space is "Ġ")
    token_types: tuple[int, ...]  # id -> gguf.TokenType (1 normal, 3 control, 4 user-defined)
    merges: tuple[str, ...]  # "left right", highest priority first
    pre: str  # tokenizer.ggml.pre
    bos_token_id: int | None
    eos_token_id: int | None
    unk_token_id: int | None
    pad_token_id: int | None
    add_bos_token: bool
    add_eos_token: bool
    chat_template: str | None

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.token_types):
            raise GGUFConvertError(
                f"{len(self.tokens)} tokens but {len(self.token_types)} token types"
            )
        for key in ("bos_token_id", "eos_token_id", "unk_token_id", "pad_token_id"):
            token_id = getattr(self, key)
            if token_id is not None and not 0 <= token_id < len(self.tokens):
                raise GGUFConvertError(f"{key} {token_id} is outside the vocabulary")


def read_vocab(reader: GGUFReader) -> GGUFVocab:
    """The tokenizer metadata of a GGUF file; only byte-level BPE is accepted."""
    model = field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise GGUFConvertError(
            f"tokenizer.ggml.model {model!r} is not supported (only byte-level BPE, 'gpt2')"
        )
    return GGUFVocab(
        tokens=tuple(field(reader, "tokenizer.ggml.tokens")),
        token_types=tuple(field(reader, "tokenizer.ggml.token_type")),
        merges=tuple(field(reader, "tokenizer.ggml.merges")),
        # Files written before the key existed used llama.cpp's "default" split.
        pre=field(reader, "tokenizer.ggml.pre", "default"),
        bos_token_id=field(reader, "tokenizer.ggml.bos_token_id", None),
        eos_token_id=field(reader, "tokenizer.ggml.eos_token_id", None),
        unk_token_id=field(reader, "tokenizer.ggml.unknown_token_id", None),
        pad_token_id=field(reader, "tokenizer.ggml.padding_token_id", None),
        add_bos_token=field(reader, "tokenizer.ggml.add_bos_token", False),
        add_eos_token=field(reader, "tokenizer.ggml.add_eos_token", False),
        chat_template=field(reader, "tokenizer.chat_template", None),
    )


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The HF pre-tokenizer for a `tokenizer.ggml.pre` value."""
    if pre in ("gpt2", "default"):
        # GPT-2's split. llama.cpp's fallback "default" regex differs from it in corner
        # cases that no HF tokenizer reproduces; such (old) files get GPT-2's split.
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder"):
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    split = {"qwen2": _QWEN2_SPLIT, "llama-bpe": _LLAMA3_SPLIT}.get(pre)
    if split is None:
        raise GGUFConvertError(
            f"tokenizer.ggml.pre {pre!r} is not supported "
            "(supported: default, gpt2, smollm, starcoder, qwen2, llama-bpe)"
        )
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _post_processor(vocab: GGUFVocab) -> processors.PostProcessor:
    """ByteLevel offsets, plus BOS/EOS insertion when the GGUF asks for it."""
    byte_level = processors.ByteLevel(trim_offsets=False)
    if not (vocab.add_bos_token or vocab.add_eos_token):
        return byte_level
    specials: list[tuple[str, int]] = []
    head: list[str] = []
    tail: list[str] = []
    for wanted, token_id, side in (
        (vocab.add_bos_token, vocab.bos_token_id, head),
        (vocab.add_eos_token, vocab.eos_token_id, tail),
    ):
        if not wanted:
            continue
        if token_id is None:
            raise GGUFConvertError("the GGUF asks to add a BOS/EOS token but has no id for it")
        side.append(vocab.tokens[token_id])
        specials.append((vocab.tokens[token_id], token_id))
    template = processors.TemplateProcessing(
        single=[*head, "$A:0", *tail],
        pair=[*head, "$A:0", *tail, *(f"{t}:1" for t in head), "$B:1", *(f"{t}:1" for t in tail)],
        special_tokens=specials,
    )
    return processors.Sequence([byte_level, template])


def build_tokenizer(vocab: GGUFVocab) -> Tokenizer:
    """A byte-level BPE `tokenizers.Tokenizer` equivalent to the model's original one."""
    ids = {token: i for i, token in enumerate(vocab.tokens)}
    if len(ids) != len(vocab.tokens):
        raise GGUFConvertError("the GGUF vocabulary has duplicate tokens")
    merges = [tuple(m.split(" ")) for m in vocab.merges]
    bad = next((m for m in merges if len(m) != 2), None)
    if bad is not None:
        raise GGUFConvertError(f"malformed merge {' '.join(bad)!r}")
    bpe = models.BPE(
        vocab=ids,
        merges=merges,
        fuse_unk=False,
        byte_fallback=False,
        ignore_merges=vocab.pre == "llama-bpe",  # as Llama 3's tokenizer.json
    )
    tokenizer = Tokenizer(bpe)
    if vocab.pre == "qwen2":
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = _pre_tokenizer(vocab.pre)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = _post_processor(vocab)
    # Control tokens (<|im_start|>, ...) are matched whole before BPE and skipped when
    # decoding with skip_special_tokens; user-defined ones are matched whole but kept.
    tokenizer.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, kind in zip(vocab.tokens, vocab.token_types, strict=True)
            if kind == TokenType.CONTROL
        ]
    )
    tokenizer.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, kind in zip(vocab.tokens, vocab.token_types, strict=True)
            if kind == TokenType.USER_DEFINED
        ]
    )
    return tokenizer


def tokenizer_config(vocab: GGUFVocab, model_max_length: int) -> dict[str, Any]:
    """The `tokenizer_config.json` of the converted model."""
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": vocab.add_bos_token,
        "add_eos_token": vocab.add_eos_token,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
    }
    for key, token_id in (
        ("bos_token", vocab.bos_token_id),
        ("eos_token", vocab.eos_token_id),
        ("unk_token", vocab.unk_token_id),
        ("pad_token", vocab.pad_token_id),
    ):
        if token_id is not None:
            config[key] = vocab.tokens[token_id]
    if vocab.chat_template is not None:
        config["chat_template"] = vocab.chat_template
    return config

"""Structured output with xgrammar: compile a request's grammar once, mask its logits per token.

A request asks through `SamplingParams.guided_kind` / `guided_spec` (see GUIDED_KINDS).
`GrammarCompilers` compiles each distinct (kind, spec) once (LRU cache) against the model's
tokenizer, read at the first guided request; any thread may call it (one lock guards the
compiler and the cache). `GrammarState` is one request's matcher, rebuilt from the output
tokens so far (`GrammarState.replay`), so a decode worker, a resumed or a migrated request
continues from exactly where the grammar was. The sampler masks only the rows that carry one.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from shared.engine.errors import InvalidRequest
from shared.engine.sampling_params import GUIDED_KINDS

if TYPE_CHECKING:
    import xgrammar as xgr

_CACHE_SIZE = 256  # compiled grammars kept per engine


def _xgr() -> ModuleType:
    """xgrammar, imported at the first guided request: it imports transformers (seconds of
    a worker's start), which no unguided request needs."""
    import xgrammar

    return xgrammar


def tokenizer_info(
    model_dir: Path, vocab_size: int, eos_token_ids: tuple[int, ...]
) -> xgr.TokenizerInfo:
    """xgrammar's view of `model_dir/tokenizer.json`: every token's text and how it is encoded.

    `vocab_size` is the model's logits width (it may exceed the tokenizer's vocabulary).
    """
    spec = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    ids = dict(spec["model"]["vocab"])
    ids |= {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
    vocab = [""] * (max(ids.values()) + 1)
    for token, token_id in ids.items():
        vocab[token_id] = token
    return _xgr().TokenizerInfo(
        vocab,
        _vocab_type(spec.get("decoder") or {}),
        vocab_size=vocab_size,
        stop_token_ids=list(eos_token_ids),
    )


def _vocab_type(decoder: dict) -> xgr.VocabType:
    kinds = {d.get("type") for d in decoder.get("decoders", [decoder])}
    if "ByteLevel" in kinds:
        return _xgr().VocabType.BYTE_LEVEL
    if "ByteFallback" in kinds:
        return _xgr().VocabType.BYTE_FALLBACK
    return _xgr().VocabType.RAW


class GrammarCompilers:
    """Compiles guided specs for one model, each distinct one once. Thread-safe."""

    def __init__(self, model_dir: Path, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._lock = threading.Lock()  # guards _compiler (built at first use) and _cache
        self._compiler: xgr.GrammarCompiler | None = None
        self._cache: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()

    def compile(self, kind: str, spec: str) -> xgr.CompiledGrammar:
        """InvalidRequest (field guided_spec, or guided_kind) when xgrammar cannot compile it."""
        key = (kind, spec)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            if self._compiler is None:
                info = tokenizer_info(self.model_dir, self.vocab_size, self.eos_token_ids)
                self._compiler = _xgr().GrammarCompiler(info, max_threads=1)
            try:
                compiled = self._compile(self._compiler, kind, spec)
            except (RuntimeError, ValueError, TypeError) as exc:
                raise InvalidRequest("guided_spec", f"invalid {kind}: {exc}") from None
            self._cache[key] = compiled
            if len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
            return compiled

    @staticmethod
    def _compile(compiler: xgr.GrammarCompiler, kind: str, spec: str) -> xgr.CompiledGrammar:
        if kind in ("json_object", "json_schema"):
            # Compact separators: free whitespace lets a model pad its output forever.
            schema = spec or '{"type": "object"}'
            return compiler.compile_json_schema(schema, any_whitespace=False)
        if kind == "regex":
            return compiler.compile_regex(spec)
        if kind == "grammar":
            return compiler.compile_grammar(spec)
        if kind == "choice":
            choices = json.loads(spec)  # a JSON list of strings; a JSON string is an EBNF literal
            rules = " | ".join(json.dumps(c) for c in choices)
            return compiler.compile_grammar(f"root ::= {rules}")
        reason = f"unknown guided kind {kind!r}; expected one of {list(GUIDED_KINDS)}"
        raise InvalidRequest("guided_kind", reason)


class GrammarState:
    """One request's position in its grammar."""

    def __init__(self, compiled: xgr.CompiledGrammar, vocab_size: int) -> None:
        self._matcher = _xgr().GrammarMatcher(compiled)
        self._bitmask = _xgr().allocate_token_bitmask(1, vocab_size)  # [1, ceil(V / 32)] int32

    def replay(self, token_ids: list[int] | tuple[int, ...]) -> None:
        """Advance over tokens already generated (a resumed, migrated or decode-side request);
        InvalidRequest (field output_token_ids) at the first one the grammar forbids."""
        for token_id in token_ids:
            if not self._matcher.accept_token(token_id):
                reason = f"token {token_id} does not fit the request's grammar"
                raise InvalidRequest("output_token_ids", reason)

    def allows(self, token_id: int) -> bool:
        """Would the grammar take `token_id` next? Changes nothing."""
        self._matcher.fill_next_token_bitmask(self._bitmask)
        word = int(self._bitmask[0, token_id // 32])  # bit i of word j: token 32 * j + i
        return bool(word >> (token_id % 32) & 1)

    def accept(self, token_id: int) -> None:
        """Advance over a sampled token. The sampler masked every forbidden one, so a refusal
        here is a bug, not the request's fault."""
        if not self._matcher.accept_token(token_id):
            raise RuntimeError(f"sampled token {token_id} does not fit the request's grammar")

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: nothing may follow."""
        return self._matcher.is_terminated()

    def mask(self, logits: torch.Tensor) -> None:
        """logits: [V'] float32, in place: -inf for every token the grammar forbids next."""
        self._matcher.fill_next_token_bitmask(self._bitmask)  # the matcher fills it on the CPU
        _xgr().apply_token_bitmask_inplace(logits[None], self._bitmask.to(logits.device))

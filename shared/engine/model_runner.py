"""Runs one scheduled step: flat batch tensors in, one sampled token per completing chunk out."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path

import torch

from shared.engine import batch_invariant
from shared.engine.attention import get_backend
from shared.engine.attention.cpu_backend import CpuAttention
from shared.engine.attention.metadata import AttentionMetadata, PrefillChunk
from shared.engine.engine_config import EngineConfig
from shared.engine.huge_pages import move_onto_huge_pages, tensors_in, thp_mode
from shared.engine.kv_cache import KVCache
from shared.engine.lora.bank import AdapterBank, BankLimits
from shared.engine.lora.linear import attach
from shared.engine.lora.step_rows import StepRows
from shared.engine.model.families import model_class
from shared.engine.model.int8_activations import with_int8_activations
from shared.engine.model.packed_start import PackedCache, rows_of
from shared.engine.model.weights import load_weights
from shared.engine.model_config import ModelConfig
from shared.engine.prompt_logprobs import score_prompt, wants_prompt_logprobs
from shared.engine.quantization import (
    describe_shipped,
    group_quant_paths,
    int8_panels,
    quantize_weights,
    shipped_quantization,
    takes_int8_activations,
)
from shared.engine.sampler import SampledToken, Sampler, SamplingRow
from shared.engine.scheduler_output import ScheduledChunk
from shared.engine.spec_decode.verify import verify_drafts
from shared.engine.startup_phases import PhaseClock, StartupPhase
from shared.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Span:
    """One sequence's new tokens in a forward pass, and how many logits rows it wants."""

    token_ids: list[int]  # computed at positions start, start + 1, ...
    start: int
    block_table: list[int]  # the sequence's blocks; slots for every new token are allocated
    num_logits: int  # logits of the last num_logits tokens are wanted (0: none)
    adapter: str = ""  # the LoRA adapter its rows are multiplied by; "": the base model


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        num_blocks: int,
        max_len: int,
        model_dir: Path | None = None,  # default config.model_dir; a draft model passes its own
        lora: BankLimits | None = None,  # serve LoRA adapters (`adapters`) with these limits
        clock: PhaseClock | None = None,  # times its start's phases (weights, KV cache)
    ) -> None:
        clock = clock or PhaseClock()
        self.block_size = config.block_size
        self.device = device = config.torch_device
        if device.type == "cuda":
            torch.cuda.set_device(device)  # Triton launches on the current device
        if config.quantization and model_config.num_experts:
            raise ConfigError(
                f"quantization {config.quantization} is not supported for MoE models: "
                "serve them without --quantization"
            )
        self._made_of = (config, model_config, model_dir or config.model_dir, max_len)
        self._lora = lora
        self.adapters: AdapterBank | None = None  # made once: it outlives a sleep's reload
        vocab_size = self.load_model(clock)
        with clock.timing(StartupPhase.KV_ALLOCATION):
            self.kv_cache = KVCache(
                model_config, num_blocks, config.block_size, config.torch_dtype, device
            )
        self.sampler = Sampler(vocab_size, model_config.eos_token_ids, self.model.ops.native)

    def load_model(self, clock: PhaseClock | None = None) -> int:
        """Load, pack and build the model (at start, and waking up from sleep level 2); the
        rows of its head (before quantization replaces it)."""
        clock = clock or PhaseClock()
        config, model_config, model_dir, max_len = self._made_of
        device = self.device
        shipped = shipped_quantization(model_dir, config.quantization, device.type)
        packed = not config.quantization and batch_invariant.resolve(config)
        lora = self._lora
        # with adapters too: lora/linear.py adds theirs to the packed gate_up's product
        silu_mlp = model_config.hidden_act == "silu"
        cache = PackedCache.of(config, model_dir, silu_mlp) if packed and not shipped else None
        weights = cache.load(clock) if cache is not None else None
        mapped = weights is not None
        if weights is None:
            with clock.timing(StartupPhase.WEIGHTS_LOAD):
                weights = load_weights(model_dir, model_config, config.torch_dtype, device)
        activations = config.group_quant_activations
        int8_activations = takes_int8_activations(model_dir, shipped, activations)
        if int8_activations:
            vector = group_quant_paths()[1] != "generic"
            weights = with_int8_activations(weights, vector, int8_panels())
        vocab_size = rows_of(weights.lm_head)  # before quantization replaces the head
        with clock.timing(StartupPhase.WEIGHTS_PACK):
            if config.quantization:
                weights = quantize_weights(weights, config.quantization)
            elif packed and not mapped:
                weights = batch_invariant.pack_weights(weights, silu_mlp)
            moved, advised = (  # mapped: the page cache's pages, shared by the host's workers
                move_onto_huge_pages(tensors_in(weights))
                if device.type == "cpu" and not mapped
                else (0, False)
            )
            if cache is not None and not mapped:
                cache.store(weights)
            if lora is not None:
                if self.adapters is None:
                    bank = AdapterBank(model_config, lora, config.torch_dtype, device)
                    self.adapters = bank
                weights = attach(weights, self.adapters)
        if device.type == "cpu":
            matmuls = describe_shipped(shipped, int8_activations) if shipped else None
            log.info("CPU matmuls: %s", matmuls or batch_invariant.describe_matmuls(config, packed))
            pages = f"{moved >> 20} MiB on 2 MiB pages asked for" if advised else "4 KiB pages"
            pages = "mapped from the packed-weight cache" if mapped else pages
            log.info("weights: %s (transparent huge pages: %s)", pages, thp_mode())
        attention = get_backend(config.attention_backend, device)
        if isinstance(attention, CpuAttention):
            log.info(
                "CPU attention: %s",
                attention.describe(
                    model_config.num_heads,
                    model_config.num_kv_heads,
                    model_config.head_dim,
                    config.torch_dtype,
                ),
            )
        self.model = model_class(model_config)(model_config, weights, attention, max_len)
        log.info("norms, rope, KV write, SiLU: %s", self.model.ops.path)
        log.info(
            "layers: %s",
            "one native call each (csrc/cpu/decoder_layer.h)"
            if self.model.native_layers
            else "the Python loop",
        )
        return vocab_size

    @property
    def has_weights(self) -> bool:
        return hasattr(self, "model")

    def release_weights(self) -> None:
        """Drop the model and its weights (sleep level 2) until `load_model`."""
        del self.model

    def run(self, chunks: list[ScheduledChunk]) -> list[list[SampledToken]]:
        """Compute `chunks` (decodes first) and sample for those that complete, in order: one
        token per chunk, or for a verify chunk its accepted drafts and one token more."""
        completing = [chunk for chunk in chunks if chunk.completes]
        spans = [_span(chunk) for chunk in chunks]
        scoring = [
            wants_prompt_logprobs(chunk.seq, span.start)
            for chunk, span in zip(chunks, spans, strict=True)
        ]
        for span, scores in zip(spans, scoring, strict=True):
            if scores:
                span.num_logits = len(span.token_ids)  # every row: prompt_logprobs.py
        logits = self.forward(spans)
        if any(scoring):
            logits = self._score_prompts(chunks, spans, scoring, logits)
        plain = [i for i, chunk in enumerate(completing) if not chunk.draft_token_ids]
        rows = [
            SamplingRow(
                params=seq.params,
                seed=seq.seed,
                position=seq.num_tokens,
                prompt_token_ids=seq.prompt_token_ids,
                output_token_ids=seq.output_token_ids,
                grammar=seq.grammar,
            )
            for seq in (completing[i].seq for i in plain)
        ]
        if len(plain) == len(completing):  # no verify chunk: one logits row per chunk
            return [[token] for token in self.sampler(logits, rows)] if rows else []
        starts = list(accumulate((1 + len(c.draft_token_ids) for c in completing), initial=0))
        results: list[list[SampledToken]] = [[] for _ in completing]
        if rows:
            sampled = self.sampler(logits[[starts[i] for i in plain]], rows)
            for i, token in zip(plain, sampled, strict=True):
                results[i] = [token]
        for i, chunk in enumerate(completing):
            if chunk.draft_token_ids:
                rows_of_chunk = logits[starts[i] : starts[i + 1]]  # [K + 1, V]
                results[i] = verify_drafts(
                    rows_of_chunk, chunk.seq, chunk.draft_token_ids, self.sampler, chunk.draft_probs
                )
        return results

    def _score_prompts(
        self,
        chunks: list[ScheduledChunk],
        spans: list[Span],
        scoring: list[bool],
        logits: torch.Tensor,  # [sum of num_logits, V']
    ) -> torch.Tensor:
        """Score the prompt rows of the chunks that want it; returns the logits rows the
        sampler expects (a scoring chunk keeps only its last row, and only if it completes)."""
        keep: list[int] = []
        row = 0
        for chunk, span, scores in zip(chunks, spans, scoring, strict=True):
            rows = range(row, row + span.num_logits)
            if scores:
                score_prompt(
                    chunk.seq, span.start, logits[row : rows.stop, : self.sampler.vocab_size]
                )
                rows = rows[-1:] if chunk.completes else range(0)
            keep.extend(rows)
            row += span.num_logits
        return logits[torch.tensor(keep, dtype=torch.int64, device=logits.device)]

    def forward(self, spans: list[Span]) -> torch.Tensor:
        """Compute `spans` (single-token ones first) into the KV cache. Returns the wanted
        logits, [sum of num_logits, V'], span after span."""
        input_ids, positions, meta, logits_rows = self._prepare(spans)
        if self.adapters is not None:
            by_span = [(span.adapter, len(span.token_ids), span.num_logits) for span in spans]
            self.adapters.begin_step(StepRows(by_span))
        return self.model.forward(input_ids, positions, meta, self.kv_cache.layers, logits_rows)

    def _prepare(self, spans: list[Span]):
        """The step's tensors, built on the host, then one copy each to the device."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillChunk] = []
        for span in spans:
            start, row, table = span.start, len(input_ids), span.block_table
            end = start + len(span.token_ids)
            input_ids.extend(span.token_ids)
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if len(span.token_ids) == 1:
                assert not prefills, "single-token spans come first"
                decode_tables.append(table[: -(-end // bs)])
                decode_lens.append(end)
            else:
                prefills.append(
                    PrefillChunk(
                        query_start=row,
                        query_len=len(span.token_ids),
                        context_len=end,
                        block_table=self._to_device(table[: -(-end // bs)]),
                    )
                )
            logits_rows.extend(range(len(input_ids) - span.num_logits, len(input_ids)))
        mask = _decode_mask(decode_lens, bs)
        meta = AttentionMetadata(
            slot_mapping=self._to_device(slots),
            num_decodes=len(decode_tables),
            decode_block_tables=_pad_tables(decode_tables).to(self.device, non_blocking=True),
            decode_mask=None if mask is None else mask.to(self.device, non_blocking=True),
            prefills=prefills,
        )
        return (
            self._to_device(input_ids),
            self._to_device(positions),
            meta,
            self._to_device(logits_rows),
        )

    def _to_device(self, values: list[int]) -> torch.Tensor:
        """[len(values)] int64 on the runner's device (on the CPU, no copy at all)."""
        return torch.tensor(values, dtype=torch.int64).to(self.device, non_blocking=True)


def _span(chunk: ScheduledChunk) -> Span:
    """A chunk's tokens: a verify chunk is the last real token, then its drafts, and wants the
    logits of every one of its rows; another chunk wants its last row's when it completes."""
    seq, start = chunk.seq, chunk.seq.num_computed_tokens
    num_real = chunk.num_tokens - len(chunk.draft_token_ids)
    token_ids = seq.token_ids[start : start + num_real] + chunk.draft_token_ids
    num_logits = 1 + len(chunk.draft_token_ids) if chunk.completes else 0
    return Span(token_ids, start, seq.block_table, num_logits, seq.params.adapter)


def _pad_tables(tables: list[list[int]]) -> torch.Tensor:
    """[D, max_blocks] int64; short tables padded with block 0 (masked out by the lengths)."""
    width = max((len(t) for t in tables), default=0)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)


def _decode_mask(lengths: list[int], block_size: int) -> torch.Tensor | None:
    """[D, 1, 1, S] bool, True where key position < the sequence's context length. None when
    every gathered position is valid (a single decode whose context fills its blocks)."""
    if not lengths:
        return None
    width = max(-(-n // block_size) for n in lengths) * block_size
    if all(n == width for n in lengths):
        return None
    keys = torch.arange(width).unsqueeze(0)  # [1, S]
    return (keys < torch.tensor(lengths).unsqueeze(1)).view(len(lengths), 1, 1, width)

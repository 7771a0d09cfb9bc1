"""Runs one scheduled step: flat batch tensors in, one sampled token per completing chunk out."""

from __future__ import annotations

from itertools import accumulate

import torch

from shared.engine.attention import get_backend
from shared.engine.attention.metadata import AttentionMetadata, PrefillChunk
from shared.engine.engine_config import EngineConfig
from shared.engine.kv_cache import KVCache
from shared.engine.model.llama import LlamaModel
from shared.engine.model.weights import load_weights
from shared.engine.model_config import ModelConfig
from shared.engine.quantization import quantize_weights
from shared.engine.sampler import SampledToken, Sampler, SamplingRow
from shared.engine.scheduler import ScheduledChunk
from shared.engine.spec_decode.verify import verify_drafts


class ModelRunner:
    def __init__(
        self, config: EngineConfig, model_config: ModelConfig, num_blocks: int, max_len: int
    ) -> None:
        self.block_size = config.block_size
        weights = load_weights(config.model_dir, model_config, config.torch_dtype)
        vocab_size = weights.lm_head.shape[0]  # before quantization replaces the head
        if config.quantization:
            weights = quantize_weights(weights, config.quantization)
        self.model = LlamaModel(
            model_config, weights, get_backend(config.attention_backend), max_len
        )
        self.kv_cache = KVCache(model_config, num_blocks, config.block_size, config.torch_dtype)
        self.sampler = Sampler(vocab_size, model_config.eos_token_ids)

    def run(self, chunks: list[ScheduledChunk]) -> list[list[SampledToken]]:
        """Compute `chunks` (decodes first) and sample for those that complete, in order: one
        token per chunk, or for a verify chunk its accepted drafts and one token more."""
        input_ids, positions, meta, logits_rows, completing = self._prepare(chunks)
        logits = self.model.forward(input_ids, positions, meta, self.kv_cache.layers, logits_rows)
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
                    rows_of_chunk, chunk.seq, chunk.draft_token_ids, self.sampler
                )
        return results

    def _prepare(self, chunks: list[ScheduledChunk]):
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        completing = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillChunk] = []
        for chunk in chunks:
            seq, start = chunk.seq, chunk.seq.num_computed_tokens
            end = start + chunk.num_tokens
            row = len(input_ids)
            input_ids.extend(seq.token_ids[start:end])
            input_ids.extend(chunk.draft_token_ids)  # a verify chunk: last token, then drafts
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if chunk.num_tokens == 1:
                decode_tables.append(table[: -(-end // bs)])
                decode_lens.append(end)
            else:
                prefills.append(
                    PrefillChunk(
                        query_start=row,
                        query_len=chunk.num_tokens,
                        context_len=end,
                        block_table=torch.tensor(table[: -(-end // bs)], dtype=torch.int64),
                    )
                )
            if chunk.completes:  # a verify chunk wants the logits of every one of its rows
                first = len(input_ids) - 1 - len(chunk.draft_token_ids)
                logits_rows.extend(range(first, len(input_ids)))
                completing.append(chunk)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            num_decodes=len(decode_tables),
            decode_block_tables=_pad_tables(decode_tables),
            decode_mask=_decode_mask(decode_lens, bs),
            prefills=prefills,
        )
        return (
            torch.tensor(input_ids, dtype=torch.int64),
            torch.tensor(positions, dtype=torch.int64),
            meta,
            torch.tensor(logits_rows, dtype=torch.int64),
            completing,
        )


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

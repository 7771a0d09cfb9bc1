"""A draft model: a smaller model with the target's vocabulary proposes the drafts.

The draft runs in a second `ModelRunner` (its own weights and KV cache). Its cache has as
many blocks as the target's and is indexed by the same block tables: a sequence's draft KV
sits in the same block ids as its target KV, in the draft's tensors. The subtle rule is
`Sequence.num_draft_computed_tokens`, the tokens whose draft KV is valid:
- it may lag the target's count (a decode worker received the prompt's target KV only; a
  step went without drafts), and the next proposal catches up with a prefill chunk;
- after verification it is cut to the target's computed count, so the KV of rejected drafts
  is never read, only overwritten; when the blocks are freed (finish, preemption) it is 0,
  and a prefix-cache hit does not raise it (that block's draft KV may never have been made).
One proposal for a batch: a first pass over every sequence's catch-up chunk (at least its
last token) samples the first drafts, then one single-token pass per further draft. The
draft samples as the sampler would (same processing, temperature, top-k/p, min-p), drawing
with the DRAFT_STREAM; sampling rows return its distributions q for verification.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from shared.engine.logits_processing import truncated_weights
from shared.engine.model_config import ModelConfig
from shared.engine.model_runner import ModelRunner, Span
from shared.engine.sampler import Sampler, SamplingRow
from shared.engine.seeded_random import draw, uniform
from shared.engine.sequence import Sequence
from shared.engine.spec_decode.proposer import Drafts, Proposer
from shared.engine.spec_decode.verify import DRAFT_STREAM
from shared.errors import ConfigError


def check_same_vocabulary(
    target_dir: Path, target: ModelConfig, draft_dir: Path, draft: ModelConfig
) -> None:
    """Raise ConfigError unless the draft model shares the target's vocabulary: the same size
    and, when both directories have a tokenizer.json, the same token → id map."""
    if draft.vocab_size != target.vocab_size:
        raise ConfigError(
            f"draft model {draft_dir} has a vocabulary of {draft.vocab_size} tokens and the "
            f"target {target_dir} one of {target.vocab_size}: a draft model must share the "
            "target's tokenizer"
        )
    paths = [Path(d) / "tokenizer.json" for d in (target_dir, draft_dir)]
    if all(p.exists() for p in paths):
        vocabularies = [json.loads(p.read_text())["model"].get("vocab") for p in paths]
        if vocabularies[0] != vocabularies[1]:
            raise ConfigError(
                f"draft model {draft_dir} and target {target_dir} have different tokenizers"
            )


class DraftProposer(Proposer):
    def __init__(
        self,
        num_speculative_tokens: int,
        max_model_len: int,
        runner: ModelRunner,  # the draft model's
        sampler: Sampler,  # the target's: the draft processes logits exactly as it does
    ) -> None:
        super().__init__(num_speculative_tokens, max_model_len)
        if runner.sampler.vocab_size != sampler.vocab_size:
            raise ConfigError(
                f"the draft model's head has {runner.sampler.vocab_size} rows and the "
                f"target's {sampler.vocab_size}: they must share a vocabulary"
            )
        self.runner = runner
        self.sampler = sampler

    def propose(self, seqs: list[Sequence], num_drafts: list[int]) -> list[Drafts]:
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        # First pass: each sequence's tokens without draft KV yet; single-token spans first.
        todo = sorted(
            (i for i, k in enumerate(num_drafts) if k > 0),
            key=lambda i: seqs[i].num_tokens - seqs[i].num_draft_computed_tokens > 1,
        )
        spans = []
        for i in todo:
            seq = seqs[i]
            start = seq.num_draft_computed_tokens
            spans.append(Span(seq.token_ids[start:], start, seq.block_table, 1))
            seq.num_draft_computed_tokens = seq.num_tokens
        while todo:
            logits = self.runner.forward(spans)  # [len(todo), V']
            self._sample(
                logits,
                [seqs[i] for i in todo],
                [drafts[i] for i in todo],
                [probs[i] for i in todo],
            )
            todo = [i for i in todo if len(drafts[i]) < num_drafts[i]]
            spans = []
            for i in todo:  # the next pass computes the latest draft's KV
                seq = seqs[i]
                spans.append(
                    Span(drafts[i][-1:], seq.num_draft_computed_tokens, seq.block_table, 1)
                )
                seq.num_draft_computed_tokens += 1
        return [
            Drafts(d, torch.stack(p) if p else None) for d, p in zip(drafts, probs, strict=True)
        ]

    def _sample(
        self,
        logits: torch.Tensor,
        seqs: list[Sequence],
        drafts: list[list[int]],
        probs: list[list[torch.Tensor]],
    ) -> None:
        """logits: [N, V'], one row per sequence. Appends each row's draft to `drafts`, and
        for sampling rows the distribution it was drawn from to `probs`."""
        sampler = self.sampler
        rows = [
            SamplingRow(
                params=seq.params,
                seed=seq.seed,
                position=seq.num_tokens + len(d),
                prompt_token_ids=seq.prompt_token_ids,
                output_token_ids=seq.output_token_ids + d,
            )
            for seq, d in zip(seqs, drafts, strict=True)
        ]
        processed = sampler.process(logits[:, : sampler.vocab_size], rows)  # [N, V]
        token_ids = processed.argmax(dim=-1).tolist()  # greedy rows keep these
        sampling = [i for i, row in enumerate(rows) if not row.params.greedy]
        if sampling:
            weights = truncated_weights(processed[sampling], [rows[i].params for i in sampling])
            u = torch.tensor(
                [uniform(rows[i].seed, rows[i].position, DRAFT_STREAM) for i in sampling],
                dtype=torch.float64,
                device=weights.device,
            )  # [S]
            chosen = draw(weights, u).tolist()
            q = weights / weights.sum(dim=-1, keepdim=True)  # [S, V]
            for j, i in enumerate(sampling):
                token_ids[i] = chosen[j]
                probs[i].append(q[j])
        for d, token in zip(drafts, token_ids, strict=True):
            d.append(token)

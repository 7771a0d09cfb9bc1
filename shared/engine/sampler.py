"""The sampler: one token per row of a logits batch, with the raw logprobs when asked.

A call goes: drop padded vocabulary columns → bias, min_tokens and penalties for just the
rows that ask (`logits_processing.process_row`), then the grammar mask of structured-output
rows (`structured_output.GrammarState.mask`) → greedy rows take the argmax; the other
rows go through temperature, top_k, top_p and min_p (`logits_processing.truncated_weights`)
and a draw seeded by (seed, position) alone (`seeded_random`) → logprobs of the raw logits.
Rows with nothing to process never leave the batched path.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from shared.engine.logits_processing import needs_processing, process_row, truncated_weights
from shared.engine.sampling_params import SamplingParams
from shared.engine.seeded_random import draw, uniform

if TYPE_CHECKING:
    from shared.engine.structured_output import GrammarState


@dataclass(slots=True)
class SamplingRow:
    """One row of the logits batch, as the engine describes it."""

    params: SamplingParams
    seed: int  # effective seed: the engine picks one when params.seed is None
    position: int  # absolute position of the token being sampled: len(prompt) + len(output)
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # tokens generated so far (non-empty for a resumed request)
    grammar: GrammarState | None = None  # structured output: masks what the grammar forbids


@dataclass(slots=True)
class TokenLogprobs:
    token_id: int
    logprob: float  # of the chosen token, under log_softmax of the raw logits
    top: list[tuple[int, float]]  # the params.logprobs best (token id, logprob), best first


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprobs: TokenLogprobs | None  # None unless params.logprobs is not None


class Sampler:
    """Picks the next token for each row; stateless between calls."""

    def __init__(
        self, vocab_size: int, eos_token_ids: tuple[int, ...], kernels: ModuleType | None = None
    ) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        self.vocab_size = vocab_size  # logits columns from here on are padding, never sampled
        self.eos_token_ids = tuple(eos_token_ids)
        self.kernels = kernels  # the C++ kernels (argmax_rows for CPU logits), or None

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """[R, V] -> [R] int64: each row's first maximum (ties: the lowest token id)."""
        native = self.kernels is not None and logits.is_cpu and logits.dtype == torch.float32
        if native and logits.stride(-1) == 1 and logits.shape[-1] > 0:
            return self.kernels.argmax_rows(logits)  # as torch's, faster (argmax.cpp)
        return logits.argmax(dim=-1)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampledToken]:
        """logits: [N, V'] float32 with V' >= vocab_size; rows: N rows, in the same order."""
        if logits.dim() != 2 or logits.shape[0] != len(rows) or logits.shape[1] < self.vocab_size:
            raise ValueError(
                f"logits of shape {tuple(logits.shape)} do not fit {len(rows)} rows"
                f" over a vocabulary of {self.vocab_size}"
            )
        logits = logits[:, : self.vocab_size]  # [N, V]
        token_ids = self._choose(self._processed(logits, rows), rows).tolist()
        logprobs = self._logprobs(logits, token_ids, rows)
        return [SampledToken(t, lp) for t, lp in zip(token_ids, logprobs, strict=True)]

    # Speculative decoding (spec_decode/verify.py) chooses its own tokens from these two.
    def process(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """logits: [N, V]. Bias, min_tokens, penalties and grammar masks, as sampling does."""
        return self._processed(logits, rows)

    def logprobs(
        self, logits: torch.Tensor, token_ids: list[int], rows: list[SamplingRow]
    ) -> list[TokenLogprobs | None]:
        """logits: [N, V] raw. The chosen tokens' logprobs for the rows that ask, else None."""
        return self._logprobs(logits, token_ids, rows)

    def _processed(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """logits: [N, V]. A processed copy when some row needs processing, else logits."""
        todo = [
            i
            for i, r in enumerate(rows)
            if r.grammar is not None or needs_processing(r.params, len(r.output_token_ids))
        ]
        if not todo:
            return logits
        processed = logits.clone()  # [N, V]; the raw logits stay intact for logprobs
        for i in todo:
            row = rows[i]
            process_row(
                processed[i],
                row.params,
                row.prompt_token_ids,
                row.output_token_ids,
                self.eos_token_ids,
            )
            if row.grammar is not None:
                row.grammar.mask(processed[i])
        return processed

    def _choose(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """logits: [N, V] processed. Returns [N] int64 token ids."""
        greedy = [i for i, r in enumerate(rows) if r.params.greedy]
        if len(greedy) == len(rows):
            return self._argmax(logits)
        sampling = [i for i, r in enumerate(rows) if not r.params.greedy]
        u = torch.tensor(
            [uniform(rows[i].seed, rows[i].position) for i in sampling],
            dtype=torch.float64,
            device=logits.device,
        )  # [S]
        if not greedy:
            return draw(truncated_weights(logits, [r.params for r in rows]), u)
        token_ids = torch.empty(len(rows), dtype=torch.long, device=logits.device)  # [N]
        greedy_index = torch.tensor(greedy, device=logits.device)  # [G]
        token_ids[greedy_index] = self._argmax(logits[greedy_index])
        sampling_index = torch.tensor(sampling, device=logits.device)  # [S]
        weights = truncated_weights(logits[sampling_index], [rows[i].params for i in sampling])
        token_ids[sampling_index] = draw(weights, u)
        return token_ids

    def _logprobs(
        self, logits: torch.Tensor, token_ids: list[int], rows: list[SamplingRow]
    ) -> list[TokenLogprobs | None]:
        """logits: [N, V] raw. The chosen token's and the top-k logprobs for rows that ask."""
        result: list[TokenLogprobs | None] = [None] * len(rows)
        wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if not wanted:
            return result
        index = torch.tensor(wanted, device=logits.device)  # [L]
        logprobs = torch.log_softmax(logits[index], dim=-1)  # [L, V]
        chosen_ids = torch.tensor([token_ids[i] for i in wanted], device=logits.device)  # [L]
        chosen = logprobs.gather(1, chosen_ids[:, None]).squeeze(1).tolist()
        k = min(max(rows[i].params.logprobs or 0 for i in wanted), logprobs.shape[1])
        top = logprobs.topk(k, dim=-1)  # values, indices: [L, k], best first
        top_logprobs, top_ids = top.values.tolist(), top.indices.tolist()
        for j, i in enumerate(wanted):
            n = rows[i].params.logprobs or 0
            best = list(zip(top_ids[j][:n], top_logprobs[j][:n], strict=True))
            result[i] = TokenLogprobs(token_ids[i], chosen[j], best)
        return result

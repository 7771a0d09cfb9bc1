"""`LLMEngine`: the synchronous engine both worker roles run. One step = schedule → run → update.

The API is small: `add_request`, `abort_request`, `step`, plus the KV hand-off hooks.
A prefill worker adds requests with `hold_kv=True`: after the first token the request is
HELD with its blocks until `export_kv` has copied them out and `release` frees them.
A decode worker `reserve`s blocks for a prompt (RESERVED), writes the prefill worker's
blocks with `import_kv`, then `start_decode` adds the request to the running batch.
"""

from __future__ import annotations

import secrets
from dataclasses import replace

import torch

from shared.engine.block_hash import hash_full_blocks
from shared.engine.block_manager import BlockManager
from shared.engine.engine_config import EngineConfig
from shared.engine.kv_cache import KVCache
from shared.engine.kv_handoff import KVBlocks, OutOfBlocks, Reservation
from shared.engine.model_config import ModelConfig
from shared.engine.model_runner import ModelRunner
from shared.engine.outputs import RequestOutput
from shared.engine.sampler import SampledToken
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler import ScheduledChunk, Scheduler
from shared.engine.sequence import FinishReason, Sequence, SequenceStatus
from shared.engine.spec_decode import SpecDecodeStats
from shared.engine.spec_decode.draft import DraftProposer, check_same_vocabulary
from shared.engine.spec_decode.ngram import NgramProposer
from shared.engine.spec_decode.proposer import Proposer
from shared.engine.structured_output import GrammarCompilers, GrammarState, tokenizer_info


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.model_config = ModelConfig.from_dir(config.model_dir)
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        draft_config = None
        if config.draft_model_dir is not None:  # checked before any weights load
            draft_config = ModelConfig.from_dir(config.draft_model_dir)
            check_same_vocabulary(
                config.model_dir, self.model_config, config.draft_model_dir, draft_config
            )
        # The cache's memory holds the target's blocks and, beside them, the draft model's.
        bytes_per_block = sum(
            KVCache.bytes_per_block(model, config.block_size, config.torch_dtype)
            for model in (self.model_config, draft_config)
            if model is not None
        )
        num_blocks = config.num_kv_blocks or int(config.kv_cache_gib * 2**30 // bytes_per_block)
        self.block_manager = BlockManager(
            num_blocks, config.block_size, config.model_id, config.enable_prefix_caching
        )
        self.runner = ModelRunner(config, self.model_config, num_blocks, self.max_model_len)
        self.spec_stats = SpecDecodeStats()  # speculative decoding: proposed, accepted
        self.proposer = self._proposer(draft_config, num_blocks)
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_batched_tokens, config.max_num_seqs, self.proposer
        )
        self.requests: dict[str, Sequence] = {}
        self._grammars: GrammarCompilers | None = None  # built at the first guided request

    # -- requests ---------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        output_token_ids: list[int] | tuple[int, ...] = (),
        hold_kv: bool = False,
    ) -> None:
        """Queue a request. `output_token_ids` resumes one from tokens it already produced."""
        seq = self._new_sequence(request_id, prompt_token_ids, params, output_token_ids)
        seq.hold_kv = hold_kv
        self.requests[request_id] = seq
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> None:
        """Forget the request and free its blocks at once, in whatever state it is."""
        seq = self.requests.get(request_id)
        if seq is not None:
            self._finish(seq, FinishReason.ABORT)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        scheduled = self.scheduler.schedule()
        if not scheduled.chunks:
            return []
        sampled = iter(self.runner.run(scheduled.chunks))
        outputs = []
        for chunk in scheduled.chunks:
            seq = chunk.seq
            if chunk.draft_token_ids:
                outputs.append(self._append_verified(chunk, next(sampled)))
                continue
            completes = chunk.completes
            seq.num_computed_tokens += chunk.num_tokens
            self.block_manager.commit(seq)
            if completes:
                outputs.append(self._append_token(seq, next(sampled)[0]))
        return outputs

    # -- KV hand-off: prefill side ----------------------------------------------------------
    def export_kv(
        self, request_id: str, layers: range | None = None, first_block: int = 0
    ) -> KVBlocks:
        """Copy the prompt's KV blocks from `first_block` on, for `layers` (default: all)."""
        seq = self._get(request_id, SequenceStatus.HELD)
        layers = layers or range(self.model_config.num_layers)
        num_blocks = self.block_manager.blocks_for(seq.num_computed_tokens)
        block_ids = seq.block_table[first_block:num_blocks]
        hashes: list[int | None] = list(seq.block_hashes[first_block:num_blocks])
        hashes += [None] * (len(block_ids) - len(hashes))
        return KVBlocks(
            request_id=request_id,
            layer_start=layers.start,
            layer_end=layers.stop,
            first_block=first_block,
            block_hashes=hashes,
            data=self.runner.kv_cache.read_blocks(block_ids, layers),
        )

    def release(self, request_id: str) -> None:
        """The held request's KV has been shipped: free its blocks."""
        self._get(request_id, SequenceStatus.HELD)
        self.abort_request(request_id)

    # -- KV hand-off: decode side -----------------------------------------------------------
    def reserve(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        output_token_ids: list[int] | tuple[int, ...] = (),
    ) -> Reservation:
        """Hold blocks for the prompt; its cached prefix counts and needs no transfer."""
        seq = self._new_sequence(request_id, prompt_token_ids, params, output_token_ids)
        if not self.block_manager.can_allocate(seq, seq.num_tokens):
            raise OutOfBlocks(f"{request_id}: {self.block_manager.num_free_blocks} blocks free")
        self.block_manager.allocate(seq)
        num_cached = len(seq.block_table)
        self.block_manager.allocate_slots(seq, seq.num_uncomputed_tokens)
        seq.status = SequenceStatus.RESERVED
        self.requests[request_id] = seq
        return Reservation(block_ids=list(seq.block_table), num_cached_blocks=num_cached)

    def import_kv(self, request_id: str, blocks: KVBlocks) -> None:
        """Write received blocks into the reservation, after checking they belong there."""
        seq = self._get(request_id, SequenceStatus.RESERVED)
        end = blocks.first_block + len(blocks.block_hashes)
        if blocks.first_block < 0 or end > len(seq.block_table):
            raise ValueError(f"{request_id}: blocks [{blocks.first_block}, {end}) out of range")
        expected = hash_full_blocks(seq.token_ids, self.config.block_size, self.config.model_id)
        for index, block_hash in enumerate(blocks.block_hashes, start=blocks.first_block):
            if block_hash is not None and index < len(expected) and expected[index] != block_hash:
                raise ValueError(f"{request_id}: block {index} hash does not match the prompt")
        block_ids = seq.block_table[blocks.first_block : end]
        self.runner.kv_cache.write_blocks(block_ids, blocks.layers, blocks.data)

    def start_decode(self, request_id: str, first_token_id: int) -> RequestOutput:
        """All blocks are in: append the prefill worker's first token and join the batch."""
        seq = self._get(request_id, SequenceStatus.RESERVED)
        seq.num_computed_tokens = seq.num_tokens
        self.block_manager.commit(seq)
        output = self._append_token(seq, SampledToken(token_id=first_token_id, logprobs=None))
        if seq.status != SequenceStatus.FINISHED:
            self.scheduler.add_running(seq)
        return output

    # -- internals --------------------------------------------------------------------------
    def _new_sequence(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        output_token_ids: list[int] | tuple[int, ...],
    ) -> Sequence:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        tokens = [*prompt_token_ids, *output_token_ids]
        vocab = self.model_config.vocab_size
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        if any(not 0 <= t < vocab for t in tokens):
            raise ValueError(f"token ids must be in [0, {vocab})")
        if len(tokens) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(tokens)} tokens; the model's context is {self.max_model_len}"
            )
        worst_case = min(self.max_model_len, len(prompt_token_ids) + params.max_tokens)
        if self.block_manager.blocks_for(worst_case) > self.block_manager.num_blocks:
            raise ValueError(
                f"{worst_case} tokens need more KV blocks than the cache has "
                f"({self.block_manager.num_blocks}); lower max_tokens or raise the cache size"
            )
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        seq = Sequence(request_id, tokens, len(prompt_token_ids), params, seed)
        if params.guided_kind:
            seq.grammar = self._grammar_state(params)
            seq.grammar.replay(list(output_token_ids))
        return seq

    def _grammar_state(self, params: SamplingParams) -> GrammarState:
        """A fresh matcher for the request's grammar (compiled once per distinct spec)."""
        if self._grammars is None:
            vocab_size = self.runner.sampler.vocab_size
            eos = self.model_config.eos_token_ids
            info = tokenizer_info(self.config.model_dir, vocab_size, eos)
            self._grammars = GrammarCompilers(info)
        compiled = self._grammars.compile(params.guided_kind, params.guided_spec)
        return GrammarState(compiled, self._grammars.vocab_size)

    def _get(self, request_id: str, status: SequenceStatus) -> Sequence:
        seq = self.requests.get(request_id)
        if seq is None or seq.status != status:
            state = "unknown" if seq is None else seq.status.name
            raise KeyError(f"request {request_id!r} is {state}, not {status.name}")
        return seq

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Forget `seq` and free its blocks."""
        del self.requests[seq.request_id]
        self.scheduler.remove(seq)
        self.block_manager.free(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason

    # -- speculative decoding (spec_decode/) -------------------------------------------------
    def _proposer(self, draft_config: ModelConfig | None, num_blocks: int) -> Proposer | None:
        config, k, max_len = self.config, self.config.num_speculative_tokens, self.max_model_len
        if config.speculative == "ngram":
            return NgramProposer(k, max_len)
        if config.speculative == "draft":
            assert draft_config is not None and config.draft_model_dir is not None
            runner = ModelRunner(config, draft_config, num_blocks, max_len, config.draft_model_dir)
            return DraftProposer(k, max_len, runner, self.runner.sampler)
        return None

    def _append_verified(self, chunk: ScheduledChunk, tokens: list[SampledToken]) -> RequestOutput:
        """A verify chunk ran: `tokens` are its accepted drafts then one more. The KV of the last
        real token and of the accepted drafts is kept; the blocks of rejected ones go back."""
        seq = chunk.seq
        self.spec_stats.verify_steps += 1
        self.spec_stats.proposed += len(chunk.draft_token_ids)
        self.spec_stats.accepted += len(tokens) - 1
        seq.num_computed_tokens += 1  # the last real token
        outputs = []
        for index, sampled in enumerate(tokens):
            outputs.append(self._append_token(seq, sampled))
            if seq.status != SequenceStatus.RUNNING:
                break  # finished: its blocks are already freed
            if index < len(tokens) - 1:
                seq.num_computed_tokens += 1  # an accepted draft: its KV is in the cache
        if seq.status == SequenceStatus.RUNNING:
            self.block_manager.truncate(seq, seq.num_tokens)
            self.block_manager.commit(seq)
            # The draft model's KV past the target's is that of rejected drafts: stale.
            seq.num_draft_computed_tokens = min(
                seq.num_draft_computed_tokens, seq.num_computed_tokens
            )
        return replace(
            outputs[-1],
            new_token_ids=[t for out in outputs for t in out.new_token_ids],
            new_logprobs=[lp for out in outputs for lp in out.new_logprobs],
        )

    def _append_token(self, seq: Sequence, sampled: SampledToken) -> RequestOutput:
        token = sampled.token_id
        seq.token_ids.append(token)
        params = seq.params
        if seq.grammar is not None:
            seq.grammar.accept(token)
        reason = None
        if (
            token in params.stop_token_ids
            or (not params.ignore_eos and token in self.model_config.eos_token_ids)
            or (seq.grammar is not None and seq.grammar.is_terminated)
        ):
            reason = FinishReason.STOP
        elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = FinishReason.LENGTH
        output = RequestOutput(
            request_id=seq.request_id,
            new_token_ids=[token],
            new_logprobs=[sampled.logprobs] if sampled.logprobs else [],
            finish_reason=reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
        )
        if reason is not None:
            self._finish(seq, reason)
        elif seq.hold_kv:
            self.scheduler.remove(seq)
            seq.status = SequenceStatus.HELD
        return output

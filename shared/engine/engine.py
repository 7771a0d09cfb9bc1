"""`LLMEngine`: the synchronous engine both worker roles run. One step = schedule → run → update.

The API is small: `add_request`, `abort_request`, `step` (or `run_step`, which reports the
engine's own transitions as well: started, held with its blocks, finished), plus the KV
hand-off. A prefill worker adds requests with `hold_kv=True`: after the first token the
request is HELD, its blocks pinned in `kv` (kv_handoff.py) until exported and released.
A decode worker `reserve`s blocks for a prompt (RESERVED, pinned too), writes the prefill
worker's blocks into them, then `start_decode` adds the request to the running batch.

Errors (shared/engine/errors.py): a bad request raises `InvalidRequest`, an id not in the
state an operation needs `UnknownRequest`, a full cache `OutOfBlocks`. `check_request` runs
every validity check without touching the engine's state, so any thread may call it, even
while the engine's own thread is inside `step`; so may `checker` and `kv` (the copies of a
hand-off run beside the steps); the rest is for the engine's thread alone.
"""

from __future__ import annotations

import secrets
from dataclasses import replace
from pathlib import Path

import torch

from shared.engine.block_hash import block_hashes, cache_key
from shared.engine.block_manager import BlockManager
from shared.engine.engine_config import EngineConfig
from shared.engine.errors import InvalidRequest, UnknownRequest
from shared.engine.kv_cache import KVCache
from shared.engine.kv_handoff import HeldBlocks, KVBlocks, KVHandOff, PinKind, Reservation
from shared.engine.kv_tier.tier import open_tier
from shared.engine.kv_tier.tier_stats import TierStats
from shared.engine.lora.bank import AdapterBank, BankLimits
from shared.engine.lora.modules import parse_lora_modules
from shared.engine.lora.serving import adapter_stats, check_adapter, serve_adapter, stop_adapter
from shared.engine.model_config import ModelConfig
from shared.engine.model_runner import ModelRunner
from shared.engine.outputs import RequestOutput, StepOutput
from shared.engine.request_check import RequestChecker
from shared.engine.resolve import resolve
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler import BatchScheduler
from shared.engine.sequence import FinishReason, Sequence, SequenceStatus
from shared.engine.sleep_mode import put_to_sleep, wake_up
from shared.engine.spec_decode import SpecDecodeStats
from shared.engine.spec_decode.draft import DraftProposer, check_same_vocabulary
from shared.engine.spec_decode.make import make_proposer
from shared.engine.startup_phases import PhaseClock
from shared.engine.stats import (
    EngineStats,
    KVCacheEvents,
    StepCosts,
    min_stream_tokens,
    queued_prompt_tokens,
    step_shape,
)
from shared.engine.stopping import StopRules
from shared.engine.structured_output import GrammarCompilers


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.startup = PhaseClock()  # its start's phases, for the worker's report
        config = resolve(config)  # auto device, batch_invariant and dtype: this machine's
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
        models = [m for m in (self.model_config, draft_config) if m is not None]
        num_blocks = config.num_kv_blocks or KVCache.blocks_in(
            config.kv_cache_gib, config.block_size, config.torch_dtype, *models
        )
        lora = None
        if config.lora_enabled:
            lora = BankLimits(config.max_loras, config.max_lora_rank, config.lora_host_slots)
        self.runner = ModelRunner(
            config, self.model_config, num_blocks, self.max_model_len, lora=lora, clock=self.startup
        )
        self.tier = open_tier(config, self.runner.kv_cache)
        self.block_manager = BlockManager(
            num_blocks, config.block_size, config.model_id, config.enable_prefix_caching, self.tier
        )
        self.proposer = make_proposer(
            config, draft_config, num_blocks, self.max_model_len, self.runner, self.startup
        )
        self.scheduler = BatchScheduler(
            self.block_manager,
            config.token_budget,
            config.max_num_seqs,
            StopRules(self.model_config.eos_token_ids, self.max_model_len),
            self.proposer,
            max_adapters=config.max_loras if config.lora_enabled else 0,
        )
        self.requests = self.scheduler.requests  # request id -> sequence, any unfinished status
        grammars = GrammarCompilers(
            config.model_dir, self.runner.sampler.vocab_size, self.model_config.eos_token_ids
        )
        self.checker = RequestChecker(
            self.model_config.vocab_size,
            self.max_model_len,
            config.block_size,
            num_blocks,
            grammars,
        )
        self.kv = KVHandOff(self.runner.kv_cache)  # the pins of held and reserved blocks
        self.last_step_num_tokens = 0  # tokens the last step scheduled; 0: nothing could run
        self._unstarted: set[str] = set()  # added, never scheduled yet
        self._ended: list[RequestOutput] = []  # finished outside a step, for the next report
        for name, path in parse_lora_modules(config.lora_modules).items():
            self.load_adapter(name, path)  # BadAdapter: a worker does not start with one

    # -- requests ---------------------------------------------------------------------------
    def check_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        output_token_ids: list[int] | tuple[int, ...] = (),
    ) -> None:
        """Raise InvalidRequest unless the engine could ever serve this request. Safe from any
        thread: it reads only limits fixed at start and the lock-guarded grammar cache."""
        check_adapter(self.runner.adapters, params.adapter)
        self.checker.check(prompt_token_ids, params, output_token_ids)

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
        self.scheduler.add(seq)
        self._unstarted.add(request_id)

    def abort_request(self, request_id: str) -> None:
        """Forget the request and free its blocks at once, in whatever state it is. An unknown
        id is no error: the request may have finished meanwhile."""
        seq = self.requests.get(request_id)
        self._unstarted.discard(request_id)
        self.kv.forget(request_id)
        if seq is not None:
            self.scheduler.finish(seq, FinishReason.ABORT)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work() or bool(self._ended)

    def step(self) -> list[RequestOutput]:
        """Run one step; its outputs (`run_step` tells its transitions too)."""
        return self.run_step().outputs

    def run_step(self) -> StepOutput:
        """Run one step. Afterwards `last_step_num_tokens` is 0 when nothing could be scheduled
        (say every waiting request lacks blocks): stepping again before a request is added,
        aborted, released or started would schedule nothing either."""
        scheduled = self.scheduler.schedule()
        self.last_step_num_tokens = scheduled.num_tokens
        report = StepOutput(self._ended)
        report.num_prompt_tokens, report.num_decode_rows = step_shape(scheduled.chunks)
        self._ended = []
        for chunk in scheduled.chunks:
            if chunk.seq.request_id in self._unstarted:
                self._unstarted.discard(chunk.seq.request_id)
                report.started.append(chunk.seq.request_id)
        sampled = self.runner.run(scheduled.chunks) if scheduled.chunks else []
        report.outputs += self.scheduler.update(scheduled, sampled)
        for output in report.outputs:
            seq = self.requests.get(output.request_id)
            if seq is not None and seq.status == SequenceStatus.HELD:
                report.held[seq.request_id] = held = self._held_blocks(seq)
                self.kv.pin(seq.request_id, PinKind.HELD, held)
        return report

    def stats(self) -> EngineStats:
        """Counters kept as things happen: no set is copied."""
        scheduler, blocks = self.scheduler, self.block_manager
        return EngineStats(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            num_held=scheduler.num_held,
            num_reserved=scheduler.num_reserved,
            free_blocks=blocks.num_free_blocks,
            total_blocks=blocks.num_blocks,
            block_size=blocks.block_size,
            usage=blocks.usage,
            prefix_queries=blocks.prefix_queries,
            prefix_hits=blocks.prefix_hits,
            num_preemptions=scheduler.num_preemptions,
            spec_decode=replace(scheduler.spec_stats),
            queued_prompt_tokens=queued_prompt_tokens(scheduler.waiting, scheduler.running),
            min_stream_tokens=min_stream_tokens(scheduler.running),
            **adapter_stats(self.runner.adapters),
            tier=self.tier.stats() if self.tier is not None else TierStats(),
        )

    def observe_costs(self, costs: StepCosts) -> None:
        """The steps' measured costs (the engine has no clock): the tier weighs loading a
        block against recomputing it by the prefill rate."""
        if self.tier is not None:
            self.tier.policy.prefill_rate = costs.prefill_rate

    def close(self) -> None:
        """Stop the tier's writer and remove its entries. The engine takes no more steps."""
        if self.tier is not None:
            self.tier.close()

    @property
    def spec_stats(self) -> SpecDecodeStats:
        """Speculative decoding since start (live; `stats()` has a copy)."""
        return self.scheduler.spec_stats

    def take_kv_events(self) -> KVCacheEvents:
        """The prefix cache's net changes (block hashes stored, removed) since the last call,
        and the second tier's."""
        events = self.block_manager.events.take()
        if self.tier is not None:
            tier = self.tier.store.take_events()
            events.tier_stored, events.tier_removed = tier.stored, tier.removed
        return events

    # -- LoRA adapters (shared/engine/lora/) ------------------------------------------------
    @property
    def adapters(self) -> AdapterBank | None:
        """None: this engine serves no adapters (enable_lora off)."""
        return self.runner.adapters

    def load_adapter(self, name: str, path: Path) -> None:
        """Read and check a PEFT adapter and serve it as `name` (BadAdapter saying why not;
        the engine serves on). A known name is read again from `path`."""
        serve_adapter(self.runner.adapters, self._adapters_in_use(), name, path)

    def unload_adapter(self, name: str) -> None:
        """Stop serving `name`; InvalidRequest while requests use it or when it is unknown."""
        stop_adapter(self.runner.adapters, self._adapters_in_use(), name)

    # -- KV hand-off: prefill side ----------------------------------------------------------
    def export_kv(
        self, request_id: str, layers: range | None = None, first_block: int = 0
    ) -> KVBlocks:
        """Copy the held prompt's KV blocks from `first_block` on, for `layers` (default: all)."""
        self._get(request_id, SequenceStatus.HELD)
        return self.kv.export(request_id, first_block, layers)

    def release(self, request_id: str) -> None:
        """The held request's KV has been shipped: free its blocks."""
        seq = self._get(request_id, SequenceStatus.HELD)
        self.kv.forget(request_id)
        self.scheduler.finish(seq, FinishReason.ABORT)

    # -- KV hand-off: decode side -----------------------------------------------------------
    def reserve(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        output_token_ids: list[int] | tuple[int, ...] = (),
    ) -> Reservation:
        """Hold blocks for the prompt; its cached prefix counts and needs no transfer.
        OutOfBlocks when they do not fit now."""
        seq = self._new_sequence(request_id, prompt_token_ids, params, output_token_ids)
        num_cached = self.scheduler.reserve(seq)
        config, block_ids = self.config, list(seq.block_table)
        key = cache_key(config.model_id, params.adapter)
        hashes = block_hashes(seq.token_ids, config.block_size, key, len(block_ids))
        self.kv.pin(request_id, PinKind.RESERVED, HeldBlocks(block_ids, hashes))
        return Reservation(block_ids=list(seq.block_table), num_cached_blocks=num_cached)

    def import_kv(self, request_id: str, blocks: KVBlocks) -> None:
        """Write received blocks into the reservation, after checking they belong there."""
        self._get(request_id, SequenceStatus.RESERVED)
        self.kv.write(request_id, blocks)

    def start_decode(self, request_id: str, first_token_id: int) -> RequestOutput:
        """All blocks are in: append the prefill worker's first token and join the batch.
        When that token ends the request, the next step reports its finish (with no token:
        the prefill worker streamed it)."""
        seq = self._get(request_id, SequenceStatus.RESERVED)
        vocab = self.model_config.vocab_size
        if not 0 <= first_token_id < vocab:
            raise InvalidRequest("first_token_id", f"token ids must be in [0, {vocab})")
        if seq.grammar is not None and not seq.grammar.allows(first_token_id):
            reason = f"token {first_token_id} does not fit the request's grammar"
            raise InvalidRequest("first_token_id", reason)
        self.kv.forget(request_id)
        output = self.scheduler.start_decode(seq, first_token_id)
        if output.finish_reason is not None:
            self._ended.append(replace(output, new_token_ids=[], new_logprobs=[]))
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
            reason = f"request id {request_id!r} is already in the engine"
            raise InvalidRequest("request_id", reason)
        check_adapter(self.runner.adapters, params.adapter)
        grammar = self.checker.check(prompt_token_ids, params, output_token_ids)
        tokens = [*prompt_token_ids, *output_token_ids]
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        seq = Sequence(request_id, tokens, len(prompt_token_ids), params, seed)
        seq.grammar = grammar
        return seq

    def _adapters_in_use(self) -> set[str]:
        return {seq.params.adapter for seq in self.requests.values()}

    def _held_blocks(self, seq: Sequence) -> HeldBlocks:
        """A held request's prompt blocks: hash per block, None for a partly filled one."""
        num_blocks = self.block_manager.blocks_for(seq.num_computed_tokens)
        hashes: list[int | None] = list(seq.block_hashes[:num_blocks])
        hashes += [None] * (num_blocks - len(hashes))
        return HeldBlocks(seq.block_table[:num_blocks], hashes)

    def _get(self, request_id: str, status: SequenceStatus) -> Sequence:
        seq = self.requests.get(request_id)
        if seq is None or seq.status != status:
            state = "unknown" if seq is None else seq.status.name
            raise UnknownRequest(f"request {request_id!r} is {state}, not {status.name}")
        return seq

    # -- sleep (sleep_mode.py) ---------------------------------------------------------------
    def sleep(self, level: int) -> None:
        """Level 1: give back the KV pool; level 2: the weights too. EngineError while a
        block is in use."""
        put_to_sleep(self.block_manager, self._runners(), level)

    def wake_up(self) -> None:
        wake_up(self._runners())

    def _runners(self) -> list[ModelRunner]:
        proposer = self.proposer
        draft = [proposer.runner] if isinstance(proposer, DraftProposer) else []
        return [self.runner, *draft]

"""`VllmEngineClient`: the `EngineClient` of vLLM's async engine, in the worker's process.

vLLM's `AsyncLLM` runs on the worker's event loop; its engine core (scheduler and model)
runs in a process of its own, so no step ever blocks the loop. Each request is one
`generate` task whose outputs (deltas) become our `StepOutput`s; cancelling the task
aborts the request in vLLM and frees its blocks.

The hand-off between a vLLM prefill worker and a vLLM decode worker goes through vLLM's
NixlConnector (vllm_kv.py holds its state, vllm_transport.py fits it to the mesh):
- prefill: the request runs with `max_tokens=1` and `do_remote_decode`; its final output
  carries vLLM's `kv_transfer_params` (where its blocks are), reported as held.
- decode: vLLM pulls every prompt block before it recomputes the last prompt token and
  samples the first token again. That token was streamed by the prefill worker already:
  it is dropped here (and counted when it differs; both ends sample it with the same seed).
A migrated request is resubmitted with prompt + delivered tokens as its prompt; vLLM's
prefix cache serves whatever of it is still cached.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from vllm.inputs import TokensPrompt
from vllm.outputs import RequestOutput as VllmOutput
from vllm.sampling_params import SamplingParams as VllmSamplingParams
from vllm.v1.engine.async_llm import AsyncLLM

from services.worker.config import WorkerConfig
from services.worker.engine_client import EngineEvents
from services.worker.vllm_engine_args import engine_args, set_environment, vllm_engine_config
from services.worker.vllm_kv import VllmKV
from services.worker.vllm_kv_events import VllmKVEventTranslator
from services.worker.vllm_kv_subscriber import VllmKVEventSubscriber
from services.worker.vllm_lora import VllmAdapters
from services.worker.vllm_outputs import flat_block_ids, request_output
from services.worker.vllm_sampling import to_vllm
from services.worker.vllm_sleep import VllmSleep
from services.worker.vllm_stats import CounterLogger, VllmCounters
from services.worker.vllm_transport import VllmNixlTransport
from shared.engine.errors import InvalidRequest
from shared.engine.kv_handoff import HeldBlocks
from shared.engine.outputs import RequestOutput, StepOutput
from shared.engine.sequence import FinishReason
from shared.engine.spec_decode import SpecDecodeStats
from shared.engine.startup_phases import StartupPhase
from shared.engine.stats import EngineStats, KVCacheEvents
from shared.errors import ConfigError
from shared.kvtransfer import KVLayout
from shared.protocol import SubmitRequest

log = logging.getLogger(__name__)


class VllmEngineClient:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.engine_config = vllm_engine_config(config)  # ConfigError: vLLM cannot run it
        self.counters = VllmCounters()
        self.adapters = VllmAdapters(self.engine_config)  # LoRA: names as vLLM LoRARequests
        self.first_token_mismatches = 0  # decode side: vLLM's first token was not prefill's
        self._events: EngineEvents | None = None
        self._llm: AsyncLLM | None = None
        self._layout: KVLayout | None = None
        self._num_blocks = 0
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._kv_events: VllmKVEventSubscriber | None = None
        self._sleep = VllmSleep(config.engine.torch_device.type)
        self.kv = VllmKV(
            self.block_size, self.engine_config.model_id, self._check, self._decode, self._fail
        )

    async def start(self, events: EngineEvents) -> KVLayout:
        self._events = events
        set_environment(self.config)
        translator = VllmKVEventTranslator(self.block_size, self.engine_config.model_id)
        self._kv_events = kv_events = VllmKVEventSubscriber(translator)
        self._llm = llm = AsyncLLM.from_engine_args(
            engine_args(self.config, kv_events.events_config()),
            stat_loggers=[CounterLogger.factory(self.counters)],
        )
        vllm_config = llm.vllm_config
        model = vllm_config.model_config
        if vllm_config.cache_config.block_size != self.block_size:  # the scheduler hashes ours
            raise ConfigError(
                f"vLLM runs blocks of {vllm_config.cache_config.block_size} tokens, not the "
                f"--block-size {self.block_size} this worker and the scheduler hash with"
            )
        self._num_blocks = vllm_config.cache_config.num_gpu_blocks or 0
        self._layout = KVLayout(
            num_layers=model.get_num_layers(vllm_config.parallel_config),
            block_size=vllm_config.cache_config.block_size,
            num_kv_heads=model.get_num_kv_heads(vllm_config.parallel_config),
            head_dim=model.get_head_size(),
            dtype=str(model.dtype).removeprefix("torch."),
        )
        await self.adapters.start(llm)
        log.info("vLLM engine up: %d KV blocks of %d tokens", self._num_blocks, self.block_size)
        return self._layout

    def startup_phases(self) -> dict[StartupPhase, float]:
        """None apart: vLLM loads, compiles and allocates in its engine core process."""
        return {}

    async def sleep(self, level: int) -> None:
        """vLLM's own sleep where it has one (a GPU: vllm_sleep.py); EngineError elsewhere."""
        await self._sleep.sleep(self._llm, level)

    async def wake_up(self) -> None:
        await self._sleep.wake_up(self._llm)

    @property
    def block_size(self) -> int:
        return self.engine_config.block_size

    def transport(self) -> VllmNixlTransport:
        assert self._layout is not None, "start() first"
        return VllmNixlTransport(self._layout, self._num_blocks)

    async def submit(self, request: SubmitRequest, *, hold_kv: bool) -> None:
        self._check(request)
        params = {"do_remote_decode": True} if hold_kv else None
        self._spawn(request, lambda: self._sampling(request, hold_kv, params), hold=hold_kv)

    def abort(self, request_id: str) -> None:
        task = self._tasks.pop(request_id, None)
        if task is not None:
            task.cancel()
        self.kv.forget(request_id)

    def stats(self) -> EngineStats:
        """vLLM's latest counters. vLLM reports them after its steps only, so they are stale
        once it has nothing to step (the last request aborted, say): with no request of
        this worker in it, it runs nothing and its blocks count as free (those a lease
        still pins for a peer's READ are freed within `transfer_timeout`)."""
        c = self.counters
        idle = not self._tasks and not self.kv.held_params
        usage = 0.0 if idle else c.usage
        return EngineStats(
            num_running=min(c.num_running, len(self._tasks)),
            num_waiting=min(c.num_waiting, len(self._tasks)),
            num_held=len(self.kv.held_params),
            num_reserved=len(self.kv.reservations),
            free_blocks=round(self._num_blocks * (1.0 - usage)),
            total_blocks=self._num_blocks,
            block_size=self.block_size,
            usage=usage,
            prefix_queries=c.prompt_tokens,
            prefix_hits=c.prompt_tokens_not_computed,
            num_preemptions=c.num_preemptions,
            spec_decode=SpecDecodeStats(),
            costs=c.timer.current,
            **self.adapters.stats(),
        )

    async def load_adapter(self, name: str, path: str) -> None:
        assert self._llm is not None, "start() first"
        await self.adapters.load(self._llm, name, path)

    async def unload_adapter(self, name: str) -> None:
        assert self._llm is not None, "start() first"
        await self.adapters.unload(self._llm, name)

    def take_kv_events(self) -> KVCacheEvents:
        """vLLM's KV cache events since the last take, as our block hashes."""
        if self._kv_events is None:
            return KVCacheEvents()
        self._kv_events.drain()
        return self._kv_events.translator.take()

    async def drain(self, timeout: float) -> bool:
        loop = asyncio.get_running_loop()
        give_up = loop.time() + timeout
        while self._tasks and loop.time() < give_up:
            await asyncio.sleep(0.02)
        return not self._tasks

    async def cleanup(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks.values()), timeout=5.0)
        self._tasks.clear()
        self.kv.held_params.clear()
        self.kv.reservations.clear()
        llm, self._llm = self._llm, None
        if llm is not None:
            await asyncio.to_thread(llm.shutdown)
        kv_events, self._kv_events = self._kv_events, None
        if kv_events is not None:
            kv_events.close()

    # -- internals --------------------------------------------------------------------------
    def _check(self, request: SubmitRequest) -> None:
        """InvalidRequest for what vLLM would refuse (its sampling, the context length)."""
        self._sampling(request)
        self.adapters.request(request.sampling.adapter)
        max_len = self.engine_config.max_model_len
        num_tokens = len(request.prompt_token_ids) + len(request.delivered_token_ids)
        if not request.prompt_token_ids:
            raise InvalidRequest("prompt", "empty")
        if max_len is not None and num_tokens >= max_len:
            raise InvalidRequest("prompt", f"{num_tokens} tokens: the context is {max_len}")

    def _decode(self, request: SubmitRequest, params: dict[str, object], first: int) -> None:
        """A reservation's KV is offered: vLLM pulls it as the request enters it."""
        self._spawn(
            request, lambda: self._sampling(request, False, params), hold=False, drop_first=first
        )

    def _sampling(
        self,
        request: SubmitRequest,
        hold_kv: bool = False,
        kv_transfer_params: dict[str, object] | None = None,
    ) -> VllmSamplingParams:
        return to_vllm(
            request.request_id,
            request.sampling,
            len(request.delivered_token_ids),
            max_tokens=1 if hold_kv else None,
            kv_transfer_params=kv_transfer_params,
        )

    def _spawn(
        self,
        request: SubmitRequest,
        sampling: Callable[[], VllmSamplingParams],
        *,
        hold: bool,
        drop_first: int | None = None,
    ) -> None:
        request_id = request.request_id
        previous = self._tasks.pop(request_id, None)
        if previous is not None:  # a request id is unique in the table above
            previous.cancel()
        task = asyncio.create_task(self._generate(request, sampling, hold, drop_first))
        self._tasks[request_id] = task
        task.add_done_callback(lambda t: self._forget(request_id, t))

    def _forget(self, request_id: str, task: asyncio.Task[None]) -> None:
        if self._tasks.get(request_id) is task:
            del self._tasks[request_id]

    async def _generate(
        self,
        request: SubmitRequest,
        make_sampling: Callable[[], VllmSamplingParams],
        hold: bool,
        drop_first: int | None,
    ) -> None:
        """Run one request in vLLM, reporting each delta as one step of the native engine."""
        llm, events, request_id = self._llm, self._events, request.request_id
        assert llm is not None and events is not None, "start() first"
        tokens = [*request.prompt_token_ids, *request.delivered_token_ids]
        started = False
        adapter = request.sampling.adapter
        self.adapters.started(adapter)
        try:
            sampling = make_sampling()
            prompt = TokensPrompt(prompt_token_ids=tokens)
            lora = self.adapters.request(adapter)
            async for out in llm.generate(prompt, sampling, request_id, lora_request=lora):
                step = StepOutput(started=[] if started else [request_id])
                started = True
                output = request_output(request, out, sampling.logprobs)
                if drop_first is not None and output.new_token_ids:
                    self._drop_first(output, drop_first)
                    drop_first = None
                held = self._hold(request, out, output) if hold and out.finished else None
                if held is not None:
                    step.held[request_id] = held
                if output.new_token_ids or output.finish_reason is not None:
                    step.outputs.append(output)
                if step.started or step.outputs:
                    events.on_step(step, time.time())
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            events.on_request_failed(request_id, exc)
        finally:
            self.adapters.ended(adapter)

    def _hold(
        self, request: SubmitRequest, out: VllmOutput, output: RequestOutput
    ) -> HeldBlocks | None:
        """A prefill's one token is out: keep its blocks for the decode engine unless the
        request itself ends here (a stop, or max_tokens reached)."""
        remaining = request.sampling.max_tokens - len(request.delivered_token_ids)
        capped_by_us = output.finish_reason == FinishReason.LENGTH and remaining > 1
        params = out.kv_transfer_params
        if not capped_by_us:
            return None
        if not params or not params.get("remote_block_ids"):
            raise RuntimeError(f"vLLM returned no KV to hand off: {params!r}")
        output.finish_reason = None
        return self.kv.hold(request, flat_block_ids(params["remote_block_ids"]), params)

    def _drop_first(self, output: RequestOutput, first_token_id: int) -> None:
        """The decode engine's first token: the prefill worker streamed it already."""
        first = output.new_token_ids.pop(0)
        if output.new_logprobs:
            output.new_logprobs.pop(0)
        if first != first_token_id:
            self.first_token_mismatches += 1
            log.warning(
                "%s: the decode engine sampled %d first, the prefill engine %d",
                output.request_id,
                first,
                first_token_id,
            )

    def _fail(self, request_id: str, error: BaseException) -> None:
        if self._events is not None:
            asyncio.get_running_loop().call_soon(self._events.on_request_failed, request_id, error)

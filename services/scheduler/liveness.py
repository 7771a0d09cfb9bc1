"""When a silent worker is lost: one late heartbeat is not enough.

A worker silent for `heartbeat_timeout` (registry.py: `silent`) is suspect — never placed
on — and probed once: a `Probe` to `<ns>.worker.<id>.probe`, which the worker answers from
its event loop (shared/liveness_messages.py), bounded by `probe_timeout`. Then:
  - answered by the same process (epoch): alive, a busy machine delayed its beats; nothing
    migrates;
  - NATS has no subscriber for it (its connection is gone: the process died, its socket
    closed) → lost at once, without waiting out the probe;
  - no answer by the deadline (frozen, cut off), or another process answers (restarted
    under the same id) → lost.
The subtle rule: "lost" is decided only if no heartbeat came while the probe was out
(registry `lose` checks it is still suspect), so a probe answered late never loses a worker
that has since beaten; and a probe that failed while the scheduler's own NATS connection
was down decides nothing (the worker is probed again at the next sweep).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from nats.errors import Error as NatsError
from nats.errors import NoRespondersError

from services.scheduler.registry import Registry, WorkerState
from shared.bus import Bus
from shared.liveness_messages import Probe, ProbeAck
from shared.subjects import Subjects
from shared.wire_codec import WireError

log = logging.getLogger(__name__)
OnLost = Callable[[WorkerState, str], Awaitable[None]]


class Liveness:
    def __init__(
        self,
        bus: Bus,
        subjects: Subjects,
        registry: Registry,
        probe_timeout: float,
        on_lost: OnLost,
    ) -> None:
        """`on_lost(state, why)` runs once per worker declared lost (removed already)."""
        self.bus = bus
        self.subjects = subjects
        self.registry = registry
        self.probe_timeout = probe_timeout
        self.on_lost = on_lost
        self._probes: set[asyncio.Task[None]] = set()

    def sweep(self, now: float) -> None:
        """Probe each worker that fell silent since the last sweep."""
        for state in self.registry.silent(now):
            worker_id = state.heartbeat.worker_id
            log.info("worker %s silent for %.1f s: probing", worker_id, now - state.last_seen)
            task = asyncio.create_task(self.probe(worker_id, state.epoch, now))
            self._probes.add(task)
            task.add_done_callback(self._probes.discard)

    async def probe(self, worker_id: str, epoch: int, now: float) -> None:
        why = await self._ask(worker_id, epoch)
        if why and not self.bus.nc.is_connected:  # our outage, not the worker's
            log.info("worker %s: probe failed while disconnected (%s); later", worker_id, why)
            self.registry.recheck(worker_id)
            return
        if not why:
            log.info("worker %s answered its probe: alive", worker_id)
            self.registry.answered(worker_id, epoch, now)
            return
        state = self.registry.lose(worker_id, epoch)
        if state is not None:
            await self.on_lost(state, why)

    async def _ask(self, worker_id: str, epoch: int) -> str:
        """ "" when process `epoch` of `worker_id` answers; else why it counts as lost."""
        subject = self.subjects.probe(worker_id)
        try:
            ack = await self.bus.request(
                subject, Probe(worker_id, epoch), ProbeAck, self.probe_timeout
            )
        except NoRespondersError:
            return "its NATS connection is gone"
        except TimeoutError:
            return f"no heartbeat, and no answer to a probe in {self.probe_timeout:g} s"
        except (NatsError, WireError) as exc:
            return f"its probe failed: {exc!r}"
        if not ack.ok:
            return f"its probe was refused: {ack.error}"
        if ack.epoch != epoch:
            return f"another process (epoch {ack.epoch}) answers under its id"
        return ""

    async def stop(self) -> None:
        for task in list(self._probes):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

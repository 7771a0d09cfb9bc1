"""The packed-weight cache at a start (model/packed_cache.py holds the file format).

`PackedCache.of(config, model_dir, silu_mlp)` is this start's cache, or None where there is
none (`--no-packed-cache`, not a CPU); `load(clock)` maps it (the `weights_mapped` phase) or
says in the log why not, and `store(weights)` writes what was packed for the next start.
The subtle rule: the cache never stops a start: a file that cannot be used is packed
afresh, and one that cannot be written is logged and skipped.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from shared.engine.engine_config import EngineConfig
from shared.engine.model import packed_cache
from shared.engine.model.linear_weights import LinearWeight, PackedLinear
from shared.engine.model.weights import ModelWeights
from shared.engine.startup_phases import PhaseClock, StartupPhase

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PackedCache:
    path: Path
    key: str

    @classmethod
    def of(cls, config: EngineConfig, model_dir: Path, silu_mlp: bool) -> PackedCache | None:
        if not config.packed_cache or config.torch_device.type != "cpu":
            return None
        key = packed_cache.cache_key(model_dir, config.torch_dtype, silu_mlp)
        return cls(packed_cache.cache_path(model_dir), key)

    def load(self, clock: PhaseClock) -> ModelWeights | None:
        """The mapped weights (the time in `weights_mapped`), or None (the time in
        `weights_load`: the look was part of loading them)."""
        started = time.perf_counter()
        weights, why = packed_cache.load(self.path, self.key)
        phase = StartupPhase.WEIGHTS_LOAD if weights is None else StartupPhase.WEIGHTS_MAPPED
        clock.add(phase, time.perf_counter() - started)
        if weights is None:
            log.info("packed-weight cache %s: %s; packing", self.path, why)
        else:
            log.info("packed-weight cache %s: mapped, not packed again", self.path)
        return weights

    def store(self, weights: ModelWeights) -> None:
        started = time.perf_counter()
        try:
            size = packed_cache.store(weights, self.path, self.key)
        except packed_cache.NotCacheable as exc:
            log.info("packed-weight cache: not kept (%s)", exc)
            return
        except OSError as exc:
            log.warning("packed-weight cache %s: cannot write it (%s)", self.path, exc)
            return
        seconds = time.perf_counter() - started
        log.info("packed-weight cache %s: %d MiB written in %.2fs", self.path, size >> 20, seconds)


def rows_of(head: LinearWeight) -> int:
    """The output rows of a head: packed (mapped from the cache) or as loaded."""
    return head.out_features if isinstance(head, PackedLinear) else int(head.shape[0])

"""What a modelled worker's step, KV transfer and start-up cost, read from a JSON file
(loadtest/sim/models/NAME.json: `cpu-here`, `gpu-h100-published`, or a path).

One engine step computes prompt chunks and decode rows together; its seconds are
    fixed + prefill_token × prompt tokens + prefill_attn × Σ (prompt token × positions it
    attends to) + decode_row × rows + decode_attn × Σ (context tokens each row reads)
    + step_overhead,
with one set of coefficients per worker size in cores; `step_overhead` is what a worker's
step costs beyond the engine's forward (its NATS side, publishing tokens). A transfer of b
blocks takes latency + b × block_bytes / bytes_per_s.

The one subtle rule: every output names the model's `source` (how its figures were got):
a model built from published figures says "published figures, not measured", so no figure
of it passes for a measurement.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from shared.errors import ConfigError

MODELS_DIR = Path(__file__).parent / "models"
NAMES = ("cpu-here", "gpu-h100-published")


@dataclass(frozen=True, slots=True)
class StepCoefficients:
    """Seconds per unit, for one worker size."""

    fixed_s: float  # every step: reading the weights once, the step's glue
    prefill_token_s: float  # per prompt token computed
    prefill_attn_s: float  # per (prompt token × position it attends to)
    decode_row_s: float  # per decode row
    decode_attn_s: float  # per context token a decode row reads


@dataclass(frozen=True, slots=True)
class CostModel:
    name: str
    source: str  # how the figures were got: "calibrated on ...", "published figures, not measured"
    model: str  # the LLM the figures are for
    steps: dict[int, StepCoefficients]  # by cores per worker
    block_bytes: int  # one KV block (block_size tokens), every layer
    kv_blocks: int  # KV blocks of one worker's pool
    transfer_bytes_per_s: float
    transfer_latency_s: float  # fixed cost of one transfer
    control_latency_s: float  # one scheduler ↔ worker round trip (Reserve, task)
    start_s: float  # a new worker's start-up, until its first heartbeat
    step_overhead_s: float = 0.0  # per step, beyond the engine's forward (the worker's NATS side)
    token_budget: int = 256  # the engine's max_num_batched_tokens on this device
    max_num_seqs: int = 64
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.steps or min(self.steps) < 1:
            raise ConfigError(f"cost model {self.name}: needs step coefficients for >= 1 core")
        if min(self.block_bytes, self.kv_blocks, self.transfer_bytes_per_s) <= 0:
            raise ConfigError(f"cost model {self.name}: block_bytes, kv_blocks, bandwidth > 0")

    def coefficients(self, cores: int) -> StepCoefficients:
        """The figures for `cores`; a size not listed scales the nearest smaller one's
        per-unit terms by the ratio of cores (the fixed cost stays)."""
        if cores in self.steps:
            return self.steps[cores]
        base = max((c for c in self.steps if c <= cores), default=min(self.steps))
        c, ratio = self.steps[base], base / cores
        return StepCoefficients(
            c.fixed_s,
            c.prefill_token_s * ratio,
            c.prefill_attn_s * ratio,
            c.decode_row_s * ratio,
            c.decode_attn_s * ratio,
        )

    def step_s(
        self, cores: int, chunks: Sequence[tuple[int, int]], decode_contexts: Sequence[int]
    ) -> float:
        """One step: prompt `chunks` as (tokens, tokens before them), one decode row per
        entry of `decode_contexts` (the tokens it reads)."""
        c = self.coefficients(cores)
        tokens = sum(n for n, _ in chunks)
        attended = sum(attended_positions(n, start) for n, start in chunks)
        return (
            self.step_overhead_s
            + c.fixed_s
            + c.prefill_token_s * tokens
            + c.prefill_attn_s * attended
            + c.decode_row_s * len(decode_contexts)
            + c.decode_attn_s * sum(decode_contexts)
        )

    def transfer_s(self, num_blocks: int) -> float:
        return self.transfer_latency_s + num_blocks * self.block_bytes / self.transfer_bytes_per_s

    def as_json(self) -> dict[str, object]:
        out = asdict(self)
        out["steps"] = {str(k): asdict(v) for k, v in self.steps.items()}
        return out


def attended_positions(num_tokens: int, start: int) -> int:
    """Σ over a chunk's tokens of the positions each attends to (itself and those before)."""
    return num_tokens * start + num_tokens * (num_tokens + 1) // 2


def from_json(data: dict[str, object]) -> CostModel:
    steps = data.get("steps")
    if not isinstance(steps, dict):
        raise ConfigError("cost model: `steps` must map cores to coefficients")
    fields = {k: v for k, v in data.items() if k != "steps"}
    try:
        coefficients = {int(k): StepCoefficients(**v) for k, v in steps.items()}
        return CostModel(steps=coefficients, **fields)  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"cost model: {exc}") from None


def path_of(name_or_path: str) -> Path:
    """The file of a named model of loadtest/sim/models, or the path itself."""
    return MODELS_DIR / f"{name_or_path}.json" if name_or_path in NAMES else Path(name_or_path)


def load(name_or_path: str) -> CostModel:
    """A named model of loadtest/sim/models, or a JSON file."""
    path = path_of(name_or_path)
    if not path.is_file():
        raise ConfigError(f"--cost-model {name_or_path!r}: choose from {NAMES} or give a file")
    return from_json(json.loads(path.read_text()))


def save(model: CostModel, path: Path) -> None:
    path.write_text(json.dumps(model.as_json(), indent=1) + "\n")

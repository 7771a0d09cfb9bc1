"""The arithmetic of goodput at SLO (DistServe, OSDI '24).

A request attains the SLO when it completed with TTFT ≤ `ttft_s` and TPOT ≤ `tpot_s` (vLLM's
definitions, loadtest/metrics.py; a one-token reply has no TPOT and meets that part). The
attainment of a run is the share of its requests that attain it; the goodput of a curve is
the highest swept rate whose attainment reaches the target (0 when none does).

The one subtle rule: a failed request (an HTTP error, a broken stream, a timeout) counts as
missing the SLO: the denominator is every request sent, never the completed ones alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from loadtest.request import RequestRecord
from shared.errors import ConfigError

_UNITS = {"ms": 1e-3, "s": 1.0}


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_s: float
    tpot_s: float

    def __post_init__(self) -> None:
        if min(self.ttft_s, self.tpot_s) <= 0:
            raise ConfigError("the SLO's ttft and tpot must be positive")

    @classmethod
    def parse(cls, text: str) -> Slo:
        """`ttft=1s,tpot=40ms` → seconds. Both objectives, each with its unit (`bench serve
        --slo` reads a bare number as milliseconds, vLLM's habit): ConfigError otherwise."""
        values: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, _, value = part.partition("=")
            unit = "ms" if value.endswith("ms") else "s" if value.endswith("s") else ""
            if name not in ("ttft", "tpot") or name in values:
                raise ConfigError(f"--slo {text!r}: {part!r}: expected ttft=... and tpot=...")
            if not unit:
                raise ConfigError(f"--slo {text!r}: {part!r} needs a unit: s or ms (ttft=1s)")
            try:
                values[name] = float(value[: -len(unit)]) * _UNITS[unit]
            except ValueError:
                raise ConfigError(f"--slo {text!r}: {part!r} is not a number") from None
        if set(values) != {"ttft", "tpot"}:
            raise ConfigError(f"--slo {text!r}: give both ttft and tpot, e.g. ttft=1s,tpot=40ms")
        return cls(values["ttft"], values["tpot"])

    def met_by(self, record: RequestRecord) -> bool:
        return record.ok and self.within(record.ttft, record.tpot)

    def within(self, ttft: float, tpot: float | None) -> bool:
        """Both objectives met (no TPOT: a one-token reply has none to miss)."""
        return ttft <= self.ttft_s and (tpot is None or tpot <= self.tpot_s)


def attainment(records: Sequence[RequestRecord], slo: Slo) -> float:
    """The share of `records` (failed ones included) that attain `slo`; 0 for none."""
    if not records:
        return 0.0
    return sum(slo.met_by(r) for r in records) / len(records)


def goodput(curve: Sequence[tuple[float, float]], target: float) -> float:
    """The highest rate of `curve` ((rate, attainment) pairs) whose attainment is at least
    `target`; 0.0 when no rate reaches it."""
    return max((rate for rate, share in curve if share >= target), default=0.0)

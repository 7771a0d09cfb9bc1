"""The serving objectives as services take them on the command line: `--slo
ttft=SECONDS,tpot=SECONDS` (the planner) and `--path-slo` (the scheduler's path choice).

The one subtle rule: a bare number is seconds here (a service's flags speak seconds), where
`bench serve --slo` reads a bare number as milliseconds as vLLM does; `ms` and `s` suffixes
mean the same everywhere.
"""

from __future__ import annotations

from shared.errors import ConfigError


def parse_slo(text: str, flag: str = "--slo") -> tuple[float, float]:
    """`ttft=1,tpot=0.04` (seconds; `ms` suffix for milliseconds) → (ttft, tpot)."""
    values: dict[str, float] = {}
    for item in text.split(","):
        name, equals, raw = item.strip().partition("=")
        if name not in ("ttft", "tpot") or not equals or name in values:
            raise ConfigError(f"{flag} {text!r}: expected ttft=SECONDS,tpot=SECONDS")
        scale = 1e-3 if raw.endswith("ms") else 1.0
        try:
            values[name] = float(raw.removesuffix("ms").removesuffix("s")) * scale
        except ValueError:
            raise ConfigError(f"{flag} {text!r}: {raw!r} is no number of seconds") from None
    if values.keys() != {"ttft", "tpot"}:
        raise ConfigError(f"{flag} {text!r}: give both ttft and tpot")
    if min(values.values()) <= 0:
        raise ConfigError(f"{flag} {text!r}: the objectives must be positive")
    return values["ttft"], values["tpot"]

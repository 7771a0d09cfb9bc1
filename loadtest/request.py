"""What the harness sends (`BenchRequest`) and what it records (`RequestRecord`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True, frozen=True)
class BenchRequest:
    prompt: str | list[int]  # text, or token ids (for /v1/completions)
    prompt_len: int  # tokens, as the dataset built or estimated them
    output_len: int  # max_tokens, sent with ignore_eos
    timestamp: float | None = None  # seconds from the start (trace replay only)
    label: str = ""  # scenario task or dataset name, for the report


@dataclass(slots=True)
class RequestRecord:
    """One request as the client saw it; times are `time.perf_counter()` seconds."""

    label: str
    send: float
    chunk_times: list[float] = field(default_factory=list)  # chunks with non-empty choices
    prompt_tokens: int = 0  # from the server's usage (0 when it sent none)
    output_tokens: int = 0  # from the server's usage, else the number of content chunks
    usage_reported: bool = False
    error: str = ""  # kind of failure ("" = success), e.g. "http_429", "timeout"
    error_detail: str = ""  # the server's message or the exception, shortened
    end: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.send

    @property
    def e2el(self) -> float:
        return self.chunk_times[-1] - self.send

    @property
    def tpot(self) -> float | None:
        """(E2EL − TTFT) / (output_tokens − 1); None for single-token outputs."""
        if self.output_tokens < 2:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]

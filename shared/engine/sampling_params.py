"""Per-request sampling parameters, checked once when the request enters the engine."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_TOP_LOGPROBS = 20
# Structured output (shared/engine/structured_output.py): what guided_spec holds per kind.
GUIDED_KINDS = {
    "json_object": "nothing: any JSON object",
    "json_schema": "a JSON schema, as JSON text",
    "regex": "a regular expression",
    "grammar": "an EBNF grammar (GBNF style, rule `root`)",
    "choice": "a JSON list of strings, one of which is the whole output",
}


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """What a request asks of the sampler; names and defaults follow the OpenAI API and vLLM.

    `top_k <= 0`, `top_p == 1`, `min_p == 0` and penalties of 1 (repetition) or 0
    (frequency, presence) switch the corresponding step off. `temperature == 0` is greedy.
    `seed=None` lets the engine pick a seed when the request arrives.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    max_tokens: int = 16
    logprobs: int | None = None  # None: no logprobs; k: the chosen token's plus the top k
    prompt_logprobs: int | None = None  # None: none; k: each prompt token's plus the top k
    guided_kind: str = ""  # "" (free text) or a key of GUIDED_KINDS
    guided_spec: str = ""  # what GUIDED_KINDS[guided_kind] says
    # "": the base model; else the LoRA adapter (shared/engine/lora/) the request is served
    # with: its rows are multiplied by it, its KV blocks hash apart (block_hash.cache_key)
    adapter: str = ""

    def __post_init__(self) -> None:
        _check(0.0 <= self.temperature <= 2.0, "temperature", "must be in [0, 2]")
        _check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        _check(self.top_k >= -1, "top_k", "must be -1, 0 (off) or positive")
        _check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        _check(0.0 < self.repetition_penalty <= 2.0, "repetition_penalty", "must be in (0, 2]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
        for token_id, bias in self.logit_bias.items():
            _check(isinstance(token_id, int) and token_id >= 0, "logit_bias", "keys are token ids")
            _check(-100.0 <= bias <= 100.0, "logit_bias", "values must be in [-100, 100]")
        _check(self.seed is None or 0 <= self.seed < 2**63, "seed", "must be in [0, 2**63)")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be token ids")
        _check(self.min_tokens >= 0, "min_tokens", "must be >= 0")
        _check(self.max_tokens >= 1, "max_tokens", "must be >= 1")
        _check(self.min_tokens <= self.max_tokens, "min_tokens", "must be <= max_tokens")
        _check(
            self.logprobs is None or 0 <= self.logprobs <= MAX_TOP_LOGPROBS,
            "logprobs",
            f"must be in [0, {MAX_TOP_LOGPROBS}]",
        )
        _check(
            self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS,
            "prompt_logprobs",
            f"must be in [0, {MAX_TOP_LOGPROBS}]",
        )
        kinds = ("", *GUIDED_KINDS)
        _check(self.guided_kind in kinds, "guided_kind", f"must be one of {list(GUIDED_KINDS)}")
        _check(
            bool(self.guided_spec) == (self.guided_kind not in ("", "json_object")),
            "guided_spec",
            "must be set exactly for the kinds json_schema, regex, grammar and choice",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )


class InvalidParameter(ValueError):
    """A sampling parameter out of range; `field` names it for the API's error message."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name} {message}")
        self.field = field_name


def _check(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise InvalidParameter(field_name, message)

"""Our `SamplingParams` (what the gateway sends) as vLLM's, field by field.

Every field maps; the only refusals are values vLLM cannot take (a `choice` spec that is not
a JSON list of strings). A request resumed after migration asks only for the tokens it still
lacks, with `min_tokens` counted from where it resumes.

Seeds: a request without one gets a seed derived from its id, so the prefill worker and the
decode worker of one disaggregated request sample its first token alike (the decode engine
samples it again after pulling the KV, and the two must agree).
"""

from __future__ import annotations

import hashlib
import json

from vllm import SamplingParams as VllmSamplingParams
from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

from shared.engine.errors import InvalidRequest
from shared.engine.sampling_params import SamplingParams

SEED_MASK = 2**63 - 1


def request_seed(request_id: str, seed: int | None) -> int:
    """The request's seed, or one derived from its id (the same on every worker)."""
    if seed is not None:
        return seed
    digest = hashlib.sha256(request_id.encode()).digest()
    return int.from_bytes(digest[:8], "little") & SEED_MASK


def structured_outputs(kind: str, spec: str) -> StructuredOutputsParams | None:
    """Our guided decoding kinds (shared/engine/sampling_params.py: GUIDED_KINDS)."""
    if not kind:
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        return StructuredOutputsParams(json=spec)
    if kind == "regex":
        return StructuredOutputsParams(regex=spec)
    if kind == "grammar":
        return StructuredOutputsParams(grammar=spec)
    if kind == "choice":
        try:
            choices = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise InvalidRequest("guided_spec", f"choice is not JSON: {exc}") from None
        if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
            raise InvalidRequest("guided_spec", "choice must be a JSON list of strings")
        return StructuredOutputsParams(choice=choices)
    raise InvalidRequest("guided_kind", f"unknown kind {kind!r}")


def to_vllm(
    request_id: str,
    sampling: SamplingParams,
    num_delivered: int,
    *,
    max_tokens: int | None = None,
    kv_transfer_params: dict[str, object] | None = None,
) -> VllmSamplingParams:
    """vLLM's parameters for the rest of a request that has `num_delivered` tokens out;
    `max_tokens` caps this engine's part (a prefill worker's: 1)."""
    remaining = sampling.max_tokens - num_delivered
    if remaining < 1:
        raise InvalidRequest("max_tokens", f"{num_delivered} tokens already delivered")
    cap = min(remaining, max_tokens or remaining)
    try:
        return VllmSamplingParams(
            n=1,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=max(sampling.top_k, 0),  # ours: -1 and 0 both mean off; vLLM's 0 does
            min_p=sampling.min_p,
            repetition_penalty=sampling.repetition_penalty,
            frequency_penalty=sampling.frequency_penalty,
            presence_penalty=sampling.presence_penalty,
            logit_bias=dict(sampling.logit_bias) or None,
            seed=request_seed(request_id, sampling.seed),
            stop_token_ids=list(sampling.stop_token_ids),
            ignore_eos=sampling.ignore_eos,
            min_tokens=min(max(0, sampling.min_tokens - num_delivered), cap),
            max_tokens=cap,
            logprobs=sampling.logprobs,
            structured_outputs=structured_outputs(sampling.guided_kind, sampling.guided_spec),
            output_kind=RequestOutputKind.DELTA,
            skip_special_tokens=False,
            detokenize=False,  # the gateway detokenizes
            extra_args={"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None,
        )
    except ValueError as exc:  # vLLM's own range checks
        raise InvalidRequest("sampling", str(exc)) from None

"""vLLM's request outputs as our engine's (`RequestOutput`, `TokenLogprobs`), and the block
ids in its `kv_transfer_params`."""

from __future__ import annotations

from vllm.outputs import RequestOutput as VllmOutput

from shared.engine.outputs import RequestOutput
from shared.engine.sampler import TokenLogprobs
from shared.engine.sequence import FinishReason
from shared.protocol import SubmitRequest

FINISH_REASONS = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH}


def request_output(request: SubmitRequest, out: VllmOutput, k: int | None) -> RequestOutput:
    """One delta of vLLM's (`RequestOutputKind.DELTA`); `k`: the logprobs asked for."""
    completion = out.outputs[0]
    token_ids = list(completion.token_ids)
    finish = None
    if out.finished:  # anything but a stop or the length cap: aborted
        finish = FINISH_REASONS.get(completion.finish_reason or "", FinishReason.ABORT)
    return RequestOutput(
        request_id=request.request_id,
        new_token_ids=token_ids,
        new_logprobs=logprobs(token_ids, completion.logprobs, k),
        finish_reason=finish,
        num_prompt_tokens=len(request.prompt_token_ids),
        num_cached_tokens=out.num_cached_tokens or 0,
    )


def logprobs(token_ids: list[int], candidates: object, k: int | None) -> list[TokenLogprobs]:
    """vLLM's per-token {token id: Logprob} maps as ours: the chosen token's and the top k."""
    if k is None or not candidates:
        return []
    result = []
    for token_id, ranked_by_id in zip(token_ids, candidates, strict=True):
        ranked = sorted(ranked_by_id.items(), key=lambda item: item[1].rank or 0)
        top = [(tid, lp.logprob) for tid, lp in ranked if lp.rank is not None and lp.rank <= k]
        result.append(TokenLogprobs(token_id, ranked_by_id[token_id].logprob, top[:k]))
    return result


def flat_block_ids(remote_block_ids: object) -> list[int]:
    """vLLM's block ids: one list per KV cache group (one group for these models)."""
    assert isinstance(remote_block_ids, list | tuple)
    if remote_block_ids and isinstance(remote_block_ids[0], list | tuple):
        if len(remote_block_ids) != 1:
            raise RuntimeError(f"{len(remote_block_ids)} KV cache groups: one is supported")
        return [int(b) for b in remote_block_ids[0]]
    return [int(b) for b in remote_block_ids]

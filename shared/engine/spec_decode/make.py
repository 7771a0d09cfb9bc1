"""The proposer `--speculative` asks for: n-gram lookup, a draft model run beside the target
(its own ModelRunner, sampling with the target's sampler), or none.

The one subtle rule: the draft model's KV blocks are allocated with the target's (the same
`num_blocks`), so a sequence's block table serves both models.
"""

from __future__ import annotations

from shared.engine.engine_config import EngineConfig
from shared.engine.model_config import ModelConfig
from shared.engine.model_runner import ModelRunner
from shared.engine.spec_decode.draft import DraftProposer
from shared.engine.spec_decode.ngram import NgramProposer
from shared.engine.spec_decode.proposer import Proposer
from shared.engine.startup_phases import PhaseClock


def make_proposer(
    config: EngineConfig,
    draft_config: ModelConfig | None,
    num_blocks: int,
    max_len: int,
    target: ModelRunner,
    clock: PhaseClock,
) -> Proposer | None:
    k = config.num_speculative_tokens
    if config.speculative == "ngram":
        return NgramProposer(k, max_len)
    if config.speculative == "draft":
        assert draft_config is not None and config.draft_model_dir is not None
        runner = ModelRunner(
            config, draft_config, num_blocks, max_len, config.draft_model_dir, clock=clock
        )
        return DraftProposer(k, max_len, runner, target.sampler)
    return None

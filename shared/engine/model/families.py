"""Architecture → decoder class: which file of shared/engine/model/ runs a checkpoint."""

from __future__ import annotations

from shared.engine.model.decoder import DecoderModel
from shared.engine.model.gemma import GemmaModel
from shared.engine.model.llama import LlamaModel
from shared.engine.model.moe import MoeModel
from shared.engine.model_config import ModelConfig

FAMILIES: dict[str, type[DecoderModel]] = {
    "llama": LlamaModel,
    "moe": MoeModel,
    "gemma": GemmaModel,
}


def model_class(config: ModelConfig) -> type[DecoderModel]:
    return FAMILIES[config.family]

"""GGUF file -> HF-layout model directory (llama and qwen2 architectures).

`convert_gguf` writes, into an existing or new directory:
  config.json             hyper-parameters (gguf_metadata.hf_config)
  model.safetensors       every tensor under its HF name (gguf_tensors): with keep_quant
                          each matrix of a quantized type (gguf_quant.KEPT_TYPES; a MoE stack
                          per expert) as its layout's arrays `NAME.PART`, their parameters
                          in the file's metadata under QUANT_METADATA; every other tensor as
                          float32
  tokenizer.json          byte-level BPE built from the GGUF vocabulary (gguf_tokenizer)
  tokenizer_config.json   special tokens, add_bos_token, chat_template
  generation_config.json  bos/eos ids
It writes in place; callers that need atomicity convert into a scratch directory and
rename it (see pull.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gguf import GGUFReader
from safetensors.numpy import save_file

from shared.models.gguf_metadata import GGUFConvertError, hf_config, read_hparams
from shared.models.gguf_quant import QuantArrays
from shared.models.gguf_tensors import Tensor, read_state_dict
from shared.models.gguf_tokenizer import build_tokenizer, read_vocab, tokenizer_config
from shared.models.quant_metadata import QUANT_METADATA

__all__ = ["MODEL_FILES", "QUANT_METADATA", "GGUFConvertError", "convert_gguf"]

MODEL_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
)


def convert_gguf(gguf_path: Path, out_dir: Path, keep_quant: bool = False) -> None:
    """Convert the GGUF file at `gguf_path` into an HF-layout model directory `out_dir`;
    keep_quant: quantized matrices stay quantized (else every tensor becomes float32)."""
    reader = GGUFReader(gguf_path, "r")
    hp = read_hparams(reader)
    vocab = read_vocab(reader)
    if len(vocab.tokens) > hp.vocab_size:
        raise GGUFConvertError(
            f"{len(vocab.tokens)} tokens but the embedding has only {hp.vocab_size} rows"
        )
    out_dir.mkdir(parents=True, exist_ok=True)

    generation: dict[str, Any] = {"bos_token_id": hp.bos_token_id, "eos_token_id": hp.eos_token_id}
    if hp.pad_token_id is not None:
        generation["pad_token_id"] = hp.pad_token_id
    _write_json(out_dir / "config.json", hf_config(hp))
    _write_json(out_dir / "generation_config.json", generation)
    _write_json(
        out_dir / "tokenizer_config.json", tokenizer_config(vocab, hp.max_position_embeddings)
    )
    build_tokenizer(vocab).save(str(out_dir / "tokenizer.json"))
    # The largest file goes last: a directory with model.safetensors has all the others.
    weights = out_dir / "model.safetensors"
    arrays, metadata = flatten(read_state_dict(reader, hp, keep_quant))
    save_file(arrays, weights, metadata=metadata)
    weights.chmod(0o644)  # safetensors creates it 0600; services may run as other users


def flatten(state: dict[str, Tensor]) -> tuple[dict[str, Any], dict[str, str]]:
    """The arrays safetensors stores and its metadata: a quantized matrix NAME becomes its
    arrays NAME.PART, its parameters listed under QUANT_METADATA."""
    arrays: dict[str, Any] = {}
    quantized: dict[str, dict[str, int | str]] = {}
    for name, tensor in state.items():
        if isinstance(tensor, QuantArrays):
            quantized[name] = tensor.params()
            arrays |= {f"{name}.{part}": a for part, a in tensor.arrays().items()}
        else:
            arrays[name] = tensor
    metadata = {"format": "pt"}
    if quantized:
        metadata[QUANT_METADATA] = json.dumps(quantized, sort_keys=True)
    return arrays, metadata


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

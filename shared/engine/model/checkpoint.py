"""The tensors of a safetensors checkpoint, read one at a time and cast to the engine's dtype.

A sharded checkpoint lists its files in `model.safetensors.index.json` (its `weight_map`);
otherwise every `*.safetensors` file of the directory is read. bf16 / fp16 / fp32 files all
load into the chosen dtype; a norm that a family offsets (Gemma's 1 + w) gets its offset in
fp32 before the cast. A matrix that `pull` kept quantized (its file's metadata lists it under
QUANT_METADATA) is read by `take_linear` as it is stored, into a `GroupQuantLinear`; so is
one of an AWQ, GPTQ or compressed-tensors checkpoint (config.json's quantization_config,
shared/models/wna16.py), whose matrix NAME.weight is stored as NAME.qweight, NAME.scales, ...
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from shared.engine.model.group_quant import ARRAY_NAMES, GroupQuantLinear
from shared.engine.model.wna16_linear import wna16_linear
from shared.models.quant_metadata import QUANT_METADATA
from shared.models.wna16_config import PARTS, read_config

INDEX = "model.safetensors.index.json"


def quantized_formats(model_dir: Path) -> list[str]:
    """The formats a checkpoint keeps quantized, read from its config and files' headers
    alone; ValueError for a quantization_config that is not read."""
    wna16 = read_config(model_dir)
    return sorted(set(gguf_kept_formats(model_dir)) | ({wna16.label} if wna16 else set()))


def gguf_kept_formats(model_dir: Path) -> list[str]:
    """The GGUF formats `pull` kept in our layout, from the files' headers ([]:
    none, or no safetensors files at all)."""
    formats: set[str] = set()
    try:
        files = checkpoint_files(model_dir)
    except FileNotFoundError:
        return []
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            listed = (handle.metadata() or {}).get(QUANT_METADATA)
        formats |= {str(p.get("format")) for p in json.loads(listed or "{}").values()}
    return sorted(formats)


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / INDEX
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise FileNotFoundError(f"{model_dir}: shards {missing[:3]} of {INDEX} are missing")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors file")
    return files


class Checkpoint:
    def __init__(self, model_dir: Path, dtype: torch.dtype, device: torch.device) -> None:
        self.model_dir, self.dtype, self.device = model_dir, dtype, device
        self._files = ExitStack()
        self._where = {}
        self.quantized: dict[str, dict[str, int | str]] = {}  # name -> layout parameters
        for path in checkpoint_files(model_dir):
            handle = self._files.enter_context(safe_open(str(path), framework="pt"))
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                self._where[name] = handle
            listed = (handle.metadata() or {}).get(QUANT_METADATA)
            if listed:
                self.quantized |= json.loads(listed)
        self._formats = dict(self.quantized)  # as listed, before take_linear takes them
        self.wna16 = read_config(model_dir)  # AWQ / GPTQ / compressed-tensors; None: neither

    @property
    def quantized_formats(self) -> list[str]:
        """The formats of the matrices kept quantized, once each ([]: a float checkpoint)."""
        listed = {str(p.get("format")) for p in self._formats.values()}
        return sorted(listed | ({self.wna16.label} if self.wna16 else set()))

    def has(self, name: str) -> bool:
        return name in self._where or name in self.quantized or self._wna16_base(name) is not None

    def _wna16_base(self, name: str) -> str | None:
        """The prefix NAME. of NAME.qweight, NAME.scales, ... where the matrix NAME.weight is
        stored in AWQ / GPTQ / compressed-tensors parts; None where it is not."""
        base = name.removesuffix("weight")
        if self.wna16 is None or base == name or base + self.wna16.marker not in self._where:
            return None
        return base

    def take_linear(self, name: str) -> torch.Tensor | GroupQuantLinear:
        """A matrix as `take` gives it, or as stored where it is kept quantized (CPU only)."""
        base = self._wna16_base(name)
        if base is not None and self.wna16 is not None:
            parts = {
                part: self._where.pop(base + part).get_tensor(base + part)
                for part in PARTS[self.wna16.format]
                if base + part in self._where
            }
            try:
                return wna16_linear(self.wna16, parts)
            except ValueError as e:
                raise ValueError(f"{self.model_dir}: {self.wna16.label} {base}*: {e}") from None
        params = self.quantized.pop(name, None)
        if params is None:
            return self.take(name)
        parts = {
            # a copy: a tensor over the file's mapping keeps all of it mapped (and resident)
            part: self._where.pop(f"{name}.{part}").get_tensor(f"{name}.{part}").clone()
            for part in ARRAY_NAMES
            if f"{name}.{part}" in self._where
        }
        try:
            return GroupQuantLinear.from_tensors(params, parts)
        except ValueError as e:
            raise ValueError(f"{self.model_dir}: quantized tensor {name}: {e}") from None

    def take(self, name: str, offset: float = 0.0) -> torch.Tensor:
        """The tensor `name` (+ offset), in the engine's dtype on its device; taken once."""
        if name in self.quantized or self._wna16_base(name):
            stored = self.quantized[name].get("format") if name in self.quantized else None
            if stored is None and self.wna16 is not None:
                stored = self.wna16.label
            raise ValueError(
                f"{self.model_dir}: {name} is stored quantized ({stored}) "
                "where a float tensor is needed"
            )
        try:
            handle = self._where.pop(name)
        except KeyError:
            raise KeyError(f"{self.model_dir}: tensor {name} is missing") from None
        tensor = handle.get_tensor(name)
        if offset:
            tensor = tensor.float() + offset
        # beside quantized matrices the residual stream is fp32: norms and biases load fp32
        quantized = self._formats or self.wna16
        dtype = torch.float32 if quantized and tensor.dim() == 1 else self.dtype
        return tensor.to(device=self.device, dtype=dtype, copy=True)  # off the file's mapping

    def discard(self, name: str) -> None:
        self._where.pop(name, None)

    def check_all_used(self) -> None:
        """Raises on tensors the model never took (a layout we do not understand); closes."""
        unused = [name for name in self._where if "rotary_emb" not in name]
        unused += sorted(self.quantized)
        self._files.close()
        if unused:
            raise ValueError(f"{self.model_dir}: unexpected tensors {unused[:5]}")

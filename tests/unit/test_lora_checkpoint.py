"""A PEFT checkpoint in our per-module layout (shared/engine/lora/checkpoint.py): a fused
module (Phi-3's qkv_proj, gate_up_proj) reads as the modules it spans, each with its A; a
module an adapter leaves alone is absent; two modules over the same rows are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from shared.engine.errors import BadAdapter
from shared.engine.lora.checkpoint import read_adapter
from shared.engine.lora.targets import Target, modules
from shared.engine.model_config import ModelConfig
from tests.conftest import write_tiny_model

RANK = 4


def write(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    settings = {"peft_type": "LORA", "r": RANK, "lora_alpha": 8, "bias": "none"}
    (path / "adapter_config.json").write_text(json.dumps(settings))
    return path


def pair(name: str, a: torch.Tensor, b: torch.Tensor) -> dict[str, torch.Tensor]:
    group = "self_attn" if name[0] in "qkvo" else "mlp"
    key = f"base_model.model.model.layers.0.{group}.{name}"
    return {f"{key}.lora_A.weight": a, f"{key}.lora_B.weight": b}


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> ModelConfig:
    return ModelConfig.from_dir(write_tiny_model(tmp_path_factory.mktemp("model"), seed=1))


def test_a_fused_module_reads_as_the_modules_it_spans(config, tmp_path):
    gen = torch.Generator().manual_seed(0)
    shapes = modules(config)
    fused, split = {}, {}
    for whole, parts in (("qkv_proj", "qkv"), ("gate_up_proj", ("gate", "up"))):
        a = torch.randn(RANK, shapes[whole].in_features, generator=gen)
        b = torch.randn(shapes[whole].out_features, RANK, generator=gen)
        fused |= pair(whole, a, b)
        for part in parts:
            module = shapes[f"{part}_proj"]
            rows = b[module.row_offset : module.row_offset + module.out_features]
            split |= pair(f"{part}_proj", a.clone(), rows.clone())
    ours = [
        read_adapter(name, write(tmp_path / name, tensors), config, 16, torch.float32)
        for name, tensors in (("fused", fused), ("split", split))
    ]
    for target in (Target.QKV, Target.GATE_UP):
        one, other = (adapter.layers[0][target] for adapter in ours)
        assert one.present == other.present and all(one.present)
        assert torch.equal(one.a, other.a) and torch.equal(one.b, other.b)
    assert set(ours[0].layers[0]) == {Target.QKV, Target.GATE_UP}  # o_proj, down: absent


def test_a_module_the_adapter_leaves_alone_is_absent(config, tmp_path):
    shapes = modules(config)
    a = torch.ones(RANK, shapes["v_proj"].in_features)
    b = torch.ones(shapes["v_proj"].out_features, RANK)
    ours = read_adapter("v", write(tmp_path / "v", pair("v_proj", a, b)), config, 16, torch.float32)
    qkv = ours.layers[0][Target.QKV]
    assert qkv.present == (False, False, True)
    assert not qkv.a[:2].any() and torch.equal(qkv.a[2], a)
    v_rows = slice(shapes["v_proj"].row_offset, None)
    assert torch.equal(qkv.b[v_rows], b * 2) and not qkv.b[: v_rows.start].any()  # 8 / 4


def test_two_modules_over_the_same_rows_are_refused(config, tmp_path):
    shapes = modules(config)
    tensors = pair(
        "qkv_proj",
        torch.zeros(RANK, shapes["qkv_proj"].in_features),
        torch.zeros(shapes["qkv_proj"].out_features, RANK),
    )
    tensors |= pair(
        "q_proj",
        torch.zeros(RANK, shapes["q_proj"].in_features),
        torch.zeros(shapes["q_proj"].out_features, RANK),
    )
    with pytest.raises(BadAdapter, match="two of its modules change the same rows"):
        read_adapter("both", write(tmp_path / "both", tensors), config, 16, torch.float32)

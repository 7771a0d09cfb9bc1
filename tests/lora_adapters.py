"""Tiny PEFT LoRA adapters for the tiny test model, made with `peft` itself, and the
transformers + peft references our engine is compared with."""

from __future__ import annotations

from pathlib import Path

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def peft_model(model_dir: Path, seed: int, r: int = 4, alpha: float = 8.0, **options):
    """The tiny model with a fresh LoRA adapter of random A and B (~N(0, 0.1²)), eval mode.
    options: LoraConfig's (target_modules, use_rslora, …)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    )
    options.setdefault("target_modules", list(ALL_TARGETS))
    model = get_peft_model(base, LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, **options))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    return model.eval()


def write_adapter(model_dir: Path, out: Path, seed: int, **options) -> Path:
    """A PEFT adapter directory (adapter_config.json, adapter_model.safetensors)."""
    peft_model(model_dir, seed=seed, **options).save_pretrained(str(out))
    return out


def peft_logits(model, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), vocab] next-token logits of a transformers (+ peft) model."""
    with torch.inference_mode():
        return model(torch.tensor([token_ids])).logits[0].float()


def peft_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()

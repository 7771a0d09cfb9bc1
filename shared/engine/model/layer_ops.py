"""The per-row steps of a layer between its matmuls — RMSNorm (with the residual add before
it), SiLU(gate) * up, RoPE with the KV-cache write — on one of two paths.

`native`: csrc/cpu/fused_ops.cpp, one call and one pass over memory each, batch-invariant
(a row's result never depends on the rows around it). It runs with the `cpu` attention
backend (the C++ kernels on CPU tensors). `torch`: torch's ops (F.rms_norm, F.silu, a
complex multiply, the backend's write_kv): every other backend and device, and the
reference the native ops are tested against. The runner logs which path a model takes.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from shared.engine.attention import AttentionBackend
from shared.engine.attention.metadata import AttentionMetadata
from shared.engine.model.rope import apply_rope_


@dataclass(slots=True, frozen=True)
class StepRope:
    """One step's rotations from one rope table: the native path reads the table at the
    positions itself; the torch path gathers them once per step."""

    table: torch.Tensor  # [max_len, r/2, 2] float32 (cos, sin) view of the complex table
    positions: torch.Tensor  # [T] int64
    rotations: torch.Tensor | None  # [T, 1, r/2] complex64 (torch path)


class LayerOps:
    def __init__(self, native: ModuleType | None, eps: float) -> None:
        self.native = native  # None: the torch path
        self.eps = eps

    @property
    def path(self) -> str:
        return "native fused ops (csrc/cpu/fused_ops.cpp)" if self.native else "torch ops"

    def rope(self, table: torch.Tensor, positions: torch.Tensor) -> StepRope:
        """table: [max_len, r/2] complex64."""
        rotations = None if self.native else table[positions].unsqueeze(1)
        return StepRope(torch.view_as_real(table), positions, rotations)

    def norm(self, x: torch.Tensor, weight: torch.Tensor, bf16_out: bool = False) -> torch.Tensor:
        """RMSNorm over the last axis of x [..., n]; Gemma's (1 + w) is already in weight.
        bf16_out: the result rounded to bf16 (fp32 x), for a bf16 matmul next."""
        if self.native and x.dim() == 2 and x.stride(1) == 1:
            return self.native.rms_norm(x, weight, self.eps, bf16_out)
        out = F.rms_norm(x, weight.shape, weight, self.eps)
        return out.to(torch.bfloat16) if bf16_out else out

    def add_norm(
        self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, bf16_out: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + delta, its RMSNorm, as norm's); h [T, n] is updated in place on the native
        path."""
        if self.native:
            return h, self.native.add_rms_norm(h, delta, weight, self.eps, bf16_out)
        h = h + delta
        return h, self.norm(h, weight, bf16_out)

    def silu_mul(self, fused: torch.Tensor) -> torch.Tensor:
        """fused [T, 2 * inter] (gate, up) -> silu(gate) * up [T, inter]."""
        if self.native:
            return self.native.silu_mul(fused)
        inter = fused.shape[1] // 2
        return F.silu(fused[:, :inter]) * fused[:, inter:]

    def rope_write_kv(
        self,
        qkv: torch.Tensor,  # [T, heads + 2 * kv_heads, d]
        heads: int,
        rope: StepRope,
        cache: torch.Tensor,
        meta: AttentionMetadata,
        attention: AttentionBackend,
    ) -> torch.Tensor | None:
        """Rotate the q and k heads, then store the new tokens' k and v (rounded to the
        cache's dtype when qkv is the fp32 residual stream's and the cache bf16). Returns the
        rotated q heads in the cache's dtype, [T, heads, d], where the native kernel rounds
        them in the same pass (qkv's own then stay unrotated); else None, q rotated in
        place."""
        if self.native:
            return self.native.rope_write_kv(
                qkv, rope.table, rope.positions, cache, meta.slot_mapping, heads
            )
        kv_heads = (qkv.shape[1] - heads) // 2
        assert rope.rotations is not None
        apply_rope_(qkv[:, : heads + kv_heads], rope.rotations)
        kv = qkv[:, heads:].view(qkv.shape[0], 2, kv_heads, -1)
        attention.write_kv(cache, kv.to(cache.dtype), meta)
        return None


def layer_ops(attention: AttentionBackend, eps: float) -> LayerOps:
    """The native path with the `cpu` attention backend, torch's with every other."""
    from shared.engine.attention.cpu_backend import CpuAttention

    return LayerOps(attention.kernels if isinstance(attention, CpuAttention) else None, eps)

"""The `cpu` backend: the C++ kernels of csrc/cpu, one call per layer for the whole batch
(decodes and prefill chunks together, through the row plan of row_plan.py)."""

from __future__ import annotations

import torch

from shared.engine import native
from shared.engine.attention.base import LayerAttention, default_layer
from shared.engine.attention.metadata import AttentionMetadata
from shared.engine.attention.row_plan import RowPlan, plan_rows


class CpuAttention:
    reads_new_kv = False

    def __init__(self) -> None:
        kernels = native.load()
        if kernels is None:
            raise RuntimeError(
                "the cpu attention backend needs the C++ kernels: run `make install` "
                "(or `python -m shared.engine.native`) with a C++ compiler present"
            )
        self.kernels = kernels
        self._plan: tuple[AttentionMetadata, RowPlan] | None = None

    def describe(self, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> str:
        """The kernel's path for this cache dtype and head shape, in words (start-up log)."""
        return self.kernels.attention_path(dtype, heads, kv_heads, head_dim)

    def write_kv(self, cache: torch.Tensor, kv: torch.Tensor, meta: AttentionMetadata) -> None:
        self.kernels.write_kv(cache, kv.contiguous(), meta.slot_mapping)

    def attend(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        cache: torch.Tensor,
        meta: AttentionMetadata,
        layer: LayerAttention | None = None,
    ) -> torch.Tensor:
        layer = layer or default_layer(q)
        plan = self.plan(meta, cache.shape[1])
        q = q.contiguous()
        out = torch.empty_like(q)
        self.kernels.paged_attention(
            out,
            q,
            cache,
            plan.block_tables,
            plan.row_table,
            plan.row_context,
            layer.scale,
            layer.window,
            layer.softcap,
        )
        return out

    def plan(self, meta: AttentionMetadata, block_size: int) -> RowPlan:
        """This step's row plan (the kernel's block tables and rows), made once a step."""
        # The same metadata object serves every layer of a step: plan once per step.
        if self._plan is None or self._plan[0] is not meta:
            self._plan = (meta, plan_rows(meta, block_size))
        return self._plan[1]

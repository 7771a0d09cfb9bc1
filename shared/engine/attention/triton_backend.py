"""The `triton` backend: the kernels of triton_kernels.py, one launch pair per layer for the
whole batch (decodes and prefill chunks together, through the row plan of row_plan.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.engine.attention import triton_kernels
from shared.engine.attention.base import LayerAttention
from shared.engine.attention.metadata import AttentionMetadata
from shared.engine.attention.row_plan import RowPlan, plan_rows


@dataclass(slots=True)
class DevicePlan:
    meta: AttentionMetadata  # the step it was built for
    rows: RowPlan  # on the cache's device
    slots: torch.Tensor  # [T] int64 slot mapping, on the cache's device
    # longest row context: the number of splits, read once per step (from a GPU: one sync)
    max_context: int


class TritonAttention:
    reads_new_kv = False

    def __init__(self) -> None:
        self._plan: DevicePlan | None = None

    def write_kv(self, cache: torch.Tensor, kv: torch.Tensor, meta: AttentionMetadata) -> None:
        triton_kernels.write_kv(cache, kv, self._plan_for(meta, cache).slots)

    def attend(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        cache: torch.Tensor,
        meta: AttentionMetadata,
        layer: LayerAttention | None = None,
    ) -> torch.Tensor:
        plan = self._plan_for(meta, cache)
        if layer is None:
            return triton_kernels.paged_attention(q, cache, plan.rows, plan.max_context)
        return triton_kernels.paged_attention(
            q, cache, plan.rows, plan.max_context, layer.scale, layer.window, layer.softcap
        )

    def _plan_for(self, meta: AttentionMetadata, cache: torch.Tensor) -> DevicePlan:
        # The same metadata object serves every layer of a step: plan and copy once per step.
        if self._plan is None or self._plan.meta is not meta:
            rows = plan_rows(meta, cache.shape[1])
            self._plan = DevicePlan(
                meta,
                rows.to(cache.device),
                meta.slot_mapping.to(cache.device),
                int(rows.row_context.max()),
            )
        return self._plan

"""Two fake-transport caches joined by one fabric, for tests of a READ's life: a prefill
side of random blocks and a decode side of -1s, its READs from REMOTE into LOCAL."""

from __future__ import annotations

import torch

from shared.kvtransfer.chunks import KVLayout
from shared.kvtransfer.fake_transport import FakeFabric, FakeTransport

LAYOUT = KVLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")
REMOTE, LOCAL = [3, 5], [0, 1]


def pair() -> tuple[FakeFabric, FakeTransport, FakeTransport]:
    fabric = FakeFabric()
    shape = [8, *LAYOUT.block_shape]
    prefill = FakeTransport("prefill-0", [torch.randn(shape) for _ in range(2)], LAYOUT, fabric)
    decode = FakeTransport("decode-0", [torch.full(shape, -1.0) for _ in range(2)], LAYOUT, fabric)
    decode.connect("prefill-0", prefill.metadata(), prefill.num_blocks)
    return fabric, prefill, decode

"""On a GPU: csrc/cuda/kv_pack.cu built as a shared library and called through its C ABI
packs a request's blocks exactly as index_select does, and unpacks them back."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed"),
]
SOURCE = Path(__file__).resolve().parents[2] / "csrc" / "cuda" / "kv_pack.cu"


def build(tmp_path: Path) -> ctypes.CDLL:
    lib = tmp_path / "libkv_pack.so"
    subprocess.run(
        ["nvcc", "-shared", "-Xcompiler", "-fPIC", "-O3", str(SOURCE), "-o", str(lib)], check=True
    )
    return ctypes.CDLL(str(lib))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_pack_then_unpack_round_trips(tmp_path, dtype):
    kernels = build(tmp_path)
    layers = [torch.randn(32, 16, 2, 8, 128, device="cuda").to(dtype) for _ in range(4)]
    ids = torch.tensor([7, 3, 30, 0, 12], device="cuda")
    pointers = torch.tensor([c.data_ptr() for c in layers], device="cuda", dtype=torch.int64)
    block_bytes = layers[0][0].numel() * layers[0].element_size()
    buffer = torch.empty(len(layers), len(ids), *layers[0].shape[1:], device="cuda", dtype=dtype)
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    args = (ctypes.c_void_p(pointers.data_ptr()), len(layers), ctypes.c_void_p(ids.data_ptr()))
    tail = (len(ids), ctypes.c_int64(block_bytes), ctypes.c_void_p(buffer.data_ptr()), stream)
    assert kernels.splitserve_kv_pack(*args, *tail) == 0
    torch.cuda.synchronize()
    assert torch.equal(buffer, torch.stack([c.index_select(0, ids) for c in layers]))
    for cache in layers:
        cache.zero_()
    assert kernels.splitserve_kv_unpack(*args, *tail) == 0
    torch.cuda.synchronize()
    for i, cache in enumerate(layers):
        assert torch.equal(cache.index_select(0, ids), buffer[i])

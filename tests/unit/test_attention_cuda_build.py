"""The CUDA KV pack/unpack kernels (csrc/cuda) compile for sm_90 when nvcc is present."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parents[2] / "csrc" / "cuda" / "kv_pack.cu"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_kv_pack_compiles_for_sm90(tmp_path):
    obj = tmp_path / "kv_pack.o"
    result = subprocess.run(
        ["nvcc", "-c", "-arch=sm_90", "-O3", str(SOURCE), "-o", str(obj)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    symbols = subprocess.run(["nm", str(obj)], capture_output=True, text=True).stdout
    assert " T splitserve_kv_pack" in symbols and " T splitserve_kv_unpack" in symbols

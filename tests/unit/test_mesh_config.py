"""The mesh config file: a good one parses into models, routes and fallbacks; every bad one
is refused with the file, the line that is wrong, and why."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.mesh_config import MeshConfigError, load_mesh_config

GOOD = """\
models:
  - name: smol-a                  # the served name
    model: smollm2-135m-instruct
    prefill: 1
    decode: 2
    engine: {dtype: bfloat16, max-num-seqs: 8, enable_prefix_caching: false}
  - name: smol-b
    model_dir: /models/b
    aggregated: 1
  - name: remote-x
    upstream: http://host:8000/v1/
    upstream_model: some-name
    connect_timeout: 0.5
routes:
  - name: chat
    targets: [{model: smol-a, weight: 80}, {model: smol-b, weight: 20, traffic: canary}]
  - name: auto
    rules: [{max_prompt_tokens: 512, model: smol-a}, {model: remote-x}]
fallbacks:
  remote-x: [smol-a]
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "mesh.yaml"
    path.write_text(text)
    return path


def test_a_good_config_parses(tmp_path):
    config = load_mesh_config(write(tmp_path, GOOD))
    a, b, remote = config.models
    assert (a.name, a.model, a.prefill, a.decode, a.line) == (
        "smol-a",
        "smollm2-135m-instruct",
        1,
        2,
        2,
    )
    assert a.engine_argv == (
        "--dtype",
        "bfloat16",
        "--max-num-seqs",
        "8",
        "--no-enable-prefix-caching",
    )
    assert (b.model_dir, b.aggregated) == (Path("/models/b"), 1)
    assert remote.upstream is not None and remote.upstream.url == "http://host:8000/v1"
    assert (remote.upstream.model, remote.upstream.connect_timeout) == ("some-name", 0.5)
    assert [m.name for m in config.mesh_models] == ["smol-a", "smol-b"]
    chat, auto = config.routes
    assert [(t.model, t.weight, t.traffic) for t in chat.targets] == [
        ("smol-a", 80.0, ""), ("smol-b", 20.0, "canary")
    ]  # fmt: skip
    assert [(r.model, r.max_prompt_tokens) for r in auto.rules] == [
        ("smol-a", 512),
        ("remote-x", None),
    ]
    assert config.fallbacks_of("remote-x") == ("smol-a",) and config.fallbacks_of("smol-a") == ()


def replaced(old: str, new: str) -> str:
    assert old in GOOD
    return GOOD.replace(old, new, 1)


BAD = [
    # (text in GOOD, what replaces it, the line named, words of the message)
    ("{model: smol-b, w", "{model: smol-c, w", 16, "route 'chat': unknown model 'smol-c'"),
    ("weight: 80", "weight: 0", 16, "weight must be a number > 0, got 0"),
    ("remote-x: [smol-a]", "remote-x: [smol-a]\n  smol-a: [smol-b, remote-x]", 20,
     "fallbacks loop: remote-x -> smol-a -> remote-x"),
    ("    aggregated: 1\n", "", 7, "model 'smol-b' has no workers"),
    ("    decode: 2\n", "    decodes: 2\n", 5, "unknown key 'decodes'"),
    ("{dtype: bfloat16,", "{dtypo: bfloat16,", 6, "engine: unknown key 'dtypo'"),
    ("max-num-seqs: 8", "block-size: 32", 6, "engine block_size is the whole mesh's"),
    ("max-num-seqs: 8", "max-num-seqs: eight", 6, "engine max_num_seqs: 'eight' is not valid"),
    ("  - name: auto", "  - name: chat", 17, "two routes are named 'chat'"),
    ("  - name: auto", "  - name: smol-b", 17, "route 'smol-b' has the name of a model"),
    ("{model: remote-x}]", "{model: remote-x, max_prompt_tokens: 9}]", 18,
     "the last rule needs no condition"),
    ("http://host:8000/v1/", "host:8000", 11, "upstream must be an http(s) URL"),
    ("    model_dir: /models/b\n", "    model_dir: /models/b\n    upstream: http://h/v1\n", 7,
     "needs exactly one of model, model_dir, upstream"),
    ("model: smollm2-135m-instruct", "model: gpt-9", 3, "unknown model 'gpt-9' (known: "),
    ("prefill: 1", "prefill: -1", 4, "prefill must be an integer >= 0, got -1"),
    ("engine: {", "engine: {{", 7, "not valid YAML"),  # where the parser noticed
]  # fmt: skip


@pytest.mark.parametrize("case", range(len(BAD)))
def test_a_bad_config_is_refused_naming_its_line(tmp_path, case):
    old, new, line, words = BAD[case]
    path = write(tmp_path, replaced(old, new))
    with pytest.raises(MeshConfigError) as refused:
        load_mesh_config(path)
    message = str(refused.value)
    assert message.startswith(f"{path}:{line}: "), message
    assert words in message, message


def test_a_missing_or_empty_file_is_refused(tmp_path):
    with pytest.raises(MeshConfigError, match="cannot read"):
        load_mesh_config(tmp_path / "none.yaml")
    with pytest.raises(MeshConfigError, match="empty"):
        load_mesh_config(write(tmp_path, "# nothing\n"))
    with pytest.raises(MeshConfigError, match=r":1: the mesh config needs models"):
        load_mesh_config(write(tmp_path, "routes: []\n"))
    only_upstreams = "models:\n  - {name: r, upstream: 'http://h/v1'}\n"
    with pytest.raises(MeshConfigError, match=r":2: models: at least one model needs workers"):
        load_mesh_config(write(tmp_path, only_upstreams))


def test_the_documented_example_is_a_valid_config():
    example = Path(__file__).parents[2] / "docs" / "mesh-config.example.yaml"
    config = load_mesh_config(example)
    assert [m.name for m in config.models] == ["smol-a", "smol-b", "remote-x"]
    assert [r.name for r in config.routes] == ["chat", "auto"]
    assert config.fallbacks_of("smol-a") == ("smol-b",)

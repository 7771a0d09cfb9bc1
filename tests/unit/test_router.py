"""The router's choices: weighted targets within binomial bounds, targets reserved for a
traffic class, prompt-size rules, fallback chains, and the x-splitserve-route header."""

from __future__ import annotations

import math
import random
from collections import Counter
from pathlib import Path

import pytest

from services.gateway.router import Decision, Fallback, Router, route_header
from services.mesh_config import load_mesh_config

CONFIG = """\
models:
  - {name: smol-a, model_dir: /m, aggregated: 1}
  - {name: smol-b, model_dir: /m, aggregated: 1}
  - {name: big, model_dir: /m, decode: 1, prefill: 1}
  - {name: remote-x, upstream: "http://127.0.0.1:9/v1", upstream_model: other}
routes:
  - name: chat
    targets: [{model: smol-a, weight: 80}, {model: smol-b, weight: 20}]
  - name: canaried
    targets:
      - {model: smol-a, weight: 1}
      - {model: big, weight: 1, traffic: canary}
  - name: auto
    rules: [{max_prompt_tokens: 16, model: smol-a}, {max_prompt_tokens: 512, model: big},
            {model: remote-x}]
fallbacks:
  remote-x: [smol-a, big]
  smol-a: [smol-b]
  smol-b: [big]
"""


@pytest.fixture
def router(tmp_path: Path) -> Router:
    path = tmp_path / "mesh.yaml"
    path.write_text(CONFIG)
    return Router(load_mesh_config(path), random.Random(20))


def no_prompt() -> int:
    raise AssertionError("a weighted route does not count prompt tokens")


def test_weighted_targets_split_within_binomial_bounds(router):
    n, p = 4000, 0.2
    counts = Counter(router.decide("chat", no_prompt).target for _ in range(n))
    assert set(counts) == {"smol-a", "smol-b"}
    bound = 4.5 * math.sqrt(n * p * (1 - p))  # 4.5 sigma: a false alarm about once in 10^5
    assert abs(counts["smol-b"] - n * p) < bound, counts


def test_a_reserved_target_takes_only_its_traffic_class(router):
    plain = {router.decide("canaried", no_prompt).target for _ in range(200)}
    canary = {router.decide("canaried", no_prompt, "canary").target for _ in range(200)}
    other = {router.decide("canaried", no_prompt, "batch").target for _ in range(200)}
    assert plain == other == {"smol-a"} and canary == {"big"}


@pytest.mark.parametrize(("tokens", "model"), [(1, "smol-a"), (16, "smol-a"), (17, "big"),
                                                (512, "big"), (513, "remote-x")])  # fmt: skip
def test_the_first_rule_that_holds_picks_by_prompt_size(router, tokens, model):
    assert router.counts_prompt("auto") and not router.counts_prompt("chat")
    assert router.decide("auto", lambda: tokens).target == model
    assert router.rule_models("auto") == ["smol-a", "big", "remote-x"]
    assert router.rule_models("chat") == router.rule_models("smol-a") == []


def test_fallback_chains_are_depth_first_without_repeats(router):
    assert router.decide("remote-x", no_prompt) == Decision(
        "remote-x", "", ("remote-x", "smol-a", "smol-b", "big")
    )
    assert router.chain("smol-b") == ("smol-b", "big")
    assert router.chain("big") == ("big",)
    with pytest.raises(KeyError):
        router.decide("nope", no_prompt)
    assert router.knows("auto") and router.knows("big") and not router.knows("nope")


def test_the_route_header_says_how_the_request_got_there():
    decision = Decision("chat", "chat", ("smol-b", "big"))
    assert route_header(decision, "smol-b", []) == "route=chat; target=smol-b; served=smol-b"
    header = route_header(decision, "big", [Fallback("smol-b", 503)])
    assert header == "route=chat; target=smol-b; served=big; fallbacks=smol-b:503"
    assert route_header(Decision("big", "", ("big",)), "big", []).startswith("route=-;")

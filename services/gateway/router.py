"""Which model serves a request: the router of a mesh config, as pure functions (no I/O).

A client's `model` names a model or a route. A route picks its target:
  - `targets`: a weighted random choice. Targets reserved for a traffic class take only that
    class's requests (a class with no reserved target takes the unreserved ones);
  - `rules`: the first rule whose conditions hold (`max_prompt_tokens`: the prompt has at
    most that many tokens); the last rule has none.
The chosen model's fallback chain follows it: its fallbacks in order, each followed by its
own (depth first), no model twice. The config refuses fallback cycles, so a chain ends.
The gateway tries the chain in order while a model is unavailable (services/gateway/chain.py).

After a reload (services/gateway/reload.py) a route whose targets changed ramps: a request
takes the new route's choice with the ramp's share (0 → 1 over its seconds), else the old
route's; a model the reload removed stays reachable through the old route (`retiring`)
until the ramp ends, but is no longer called by name.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from services.mesh_config import MeshConfig, MeshModel, Route


@dataclass(frozen=True, slots=True)
class Decision:
    called: str  # the name the client asked for
    route: str  # the route that chose, "" when a model was called by name
    chain: tuple[str, ...]  # the chosen model, then its fallbacks, in the order to try

    @property
    def target(self) -> str:
        return self.chain[0]


@dataclass(frozen=True, slots=True)
class Fallback:
    model: str  # the model that could not serve
    status: int  # the HTTP status it answered (or would have)


def route_header(decision: Decision, served: str, fallbacks: list[Fallback]) -> str:
    """The `x-splitserve-route` header: how the request reached the model that served it."""
    parts = [f"route={decision.route or '-'}", f"target={decision.target}", f"served={served}"]
    if fallbacks:
        parts.append("fallbacks=" + ",".join(f"{f.model}:{f.status}" for f in fallbacks))
    return "; ".join(parts)


@dataclass(frozen=True, slots=True)
class Ramp:
    """A route moving from the previous config's `old` to the current one over `seconds`."""

    old: Route
    started: float  # time.monotonic() of the reload
    seconds: float

    def share(self, now: float) -> float:
        """The new route's share of the requests: 0 at the start, 1 from the end on."""
        if self.seconds <= 0:
            return 1.0
        return min(1.0, max(0.0, (now - self.started) / self.seconds))


class Router:
    def __init__(
        self,
        config: MeshConfig,
        rng: random.Random | None = None,
        ramps: dict[str, Ramp] | None = None,
        retiring: tuple[MeshModel, ...] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`ramps`: per route name; `retiring`: removed models the ramps' old routes name."""
        self.config = config
        self.rng = rng or random.Random()
        self.ramps = ramps or {}
        self.retiring = retiring
        self.clock = clock
        self._routes = {route.name: route for route in config.routes}
        self._models = {model.name for model in config.models}

    def model(self, name: str) -> MeshModel:
        """A model of the config, or one retiring after a reload."""
        found = [m for m in (*self.config.models, *self.retiring) if m.name == name]
        if not found:
            raise KeyError(name)
        return found[0]

    def ramping(self) -> list[str]:
        """The routes whose ramp has not ended."""
        now = self.clock()
        return [name for name, ramp in self.ramps.items() if ramp.share(now) < 1.0]

    def knows(self, name: str) -> bool:
        return name in self._routes or name in self._models

    def counts_prompt(self, name: str) -> bool:
        """The route `name` chooses by prompt size (so the caller counts its tokens)."""
        routes = [self._routes.get(name)] + ([self.ramps[name].old] if name in self.ramps else [])
        return any(
            r.max_prompt_tokens is not None for route in routes if route for r in route.rules
        )

    def rule_models(self, name: str) -> list[str]:
        """The models the rules of route `name` name, in order ([] for any other name)."""
        route = self._routes.get(name)
        return [rule.model for rule in route.rules] if route is not None else []

    def decide(self, name: str, prompt_tokens: Callable[[], int], traffic: str = "") -> Decision:
        """The chain for a request calling `name` (KeyError when it is neither a model nor a
        route); `prompt_tokens()` is called only for a route with prompt-size rules."""
        route = self._routes.get(name)
        if route is None:
            if name not in self._models:
                raise KeyError(name)
            return Decision(name, "", self.chain(name))
        target = self._choose(route, prompt_tokens, traffic)
        return Decision(name, route.name, self.chain(target))

    def chain(self, model: str) -> tuple[str, ...]:
        order: list[str] = []

        def visit(name: str) -> None:
            if name in order:
                return
            order.append(name)
            for fallback in self.config.fallbacks_of(name):
                visit(fallback)

        visit(model)
        return tuple(order)

    def _choose(self, route: Route, prompt_tokens: Callable[[], int], traffic: str) -> str:
        ramp = self.ramps.get(route.name)
        if ramp is not None and self.rng.random() >= ramp.share(self.clock()):
            route = ramp.old
        if route.rules:
            count = prompt_tokens() if self.counts_prompt(route.name) else 0
            return next(
                rule.model
                for rule in route.rules
                if rule.max_prompt_tokens is None or count <= rule.max_prompt_tokens
            )
        targets = [t for t in route.targets if traffic and t.traffic == traffic]
        targets = targets or [t for t in route.targets if not t.traffic]
        (chosen,) = self.rng.choices(targets, weights=[t.weight for t in targets])
        return chosen.model

    def names(self) -> list[tuple[str, str]]:
        """(name, what it is) for `/v1/models`: each model, then each route."""
        models = [(m.name, "upstream" if m.upstream else "model") for m in self.config.models]
        return models + [(r.name, "route") for r in self.config.routes]

"""The `routes:` and `fallbacks:` of a mesh config (services/mesh_config.py): parsed and
checked, each error naming its line. A route has weighted `targets` (a target may be reserved
for a traffic class; at least one is not) or `rules` (the last one unconditional); fallback
chains name known models and never loop back (`fallbacks loop: a -> b -> a`)."""

from __future__ import annotations

from dataclasses import dataclass

from yaml.nodes import Node

from services.mesh_yaml import Reader


@dataclass(frozen=True, slots=True)
class Target:
    model: str
    weight: float
    line: int
    traffic: str = ""  # reserved for requests of this traffic class; "": for the others


@dataclass(frozen=True, slots=True)
class Rule:
    model: str
    line: int
    max_prompt_tokens: int | None = None  # None: matches every request


@dataclass(frozen=True, slots=True)
class Route:
    name: str
    line: int
    targets: tuple[Target, ...] = ()  # weighted choice, or
    rules: tuple[Rule, ...] = ()  # the first rule that matches


def parse_route(reader: Reader, node: Node) -> Route:
    fields = reader.mapping(node, "a route", required=("name",), optional=("targets", "rules"))
    name = reader.name(fields["name"], "name")
    line = _line(node)
    if ("targets" in fields) == ("rules" in fields):
        raise reader.error(node, f"route {name!r} needs either targets or rules")
    if "targets" in fields:
        targets = tuple(
            _target(reader, n) for n in reader.sequence(fields["targets"], "targets", 1)
        )
        if all(t.traffic for t in targets):
            raise reader.error(
                fields["targets"], f"route {name!r}: every target is reserved for a traffic class"
            )
        return Route(name, line, targets=targets)
    rule_nodes = reader.sequence(fields["rules"], "rules", 1)
    rules = tuple(_rule(reader, n) for n in rule_nodes)
    if rules[-1].max_prompt_tokens is not None:
        raise reader.error(
            rule_nodes[-1], "the last rule needs no condition, so every request matches one"
        )
    return Route(name, line, rules=rules)


def _target(reader: Reader, node: Node) -> Target:
    fields = reader.mapping(node, "a target", required=("model", "weight"), optional=("traffic",))
    weight = reader.number(fields["weight"], "weight", positive=True)
    traffic = reader.name(fields["traffic"], "traffic") if "traffic" in fields else ""
    return Target(reader.name(fields["model"], "model"), weight, _line(node), traffic)


def _rule(reader: Reader, node: Node) -> Rule:
    fields = reader.mapping(node, "a rule", required=("model",), optional=("max_prompt_tokens",))
    limit = fields.get("max_prompt_tokens")
    tokens = reader.integer(limit, "max_prompt_tokens", minimum=1) if limit is not None else None
    return Rule(reader.name(fields["model"], "model"), _line(node), tokens)


def parse_fallbacks(
    reader: Reader, node: Node | None, names: set[str]
) -> tuple[tuple[str, tuple[str, ...]], ...]:
    if node is None:
        return ()
    fields = reader.mapping(node, "fallbacks", optional=None)
    chains: dict[str, tuple[str, ...]] = {}
    for model, chain_node in fields.items():
        if model not in names:
            raise reader.error(chain_node, f"fallbacks: unknown model {model!r}")
        chain = tuple(reader.name(n, "fallback") for n in reader.sequence(chain_node, model, 1))
        for other in chain:
            if other not in names:
                raise reader.error(chain_node, f"fallbacks of {model!r}: unknown model {other!r}")
        chains[model] = chain
    for model, chain_node in fields.items():
        cycle = _cycle(model, chains)
        if cycle:
            raise reader.error(chain_node, f"fallbacks loop: {' -> '.join(cycle)}")
    return tuple(chains.items())


def _cycle(start: str, chains: dict[str, tuple[str, ...]]) -> list[str]:
    """A path start -> ... -> start through the fallbacks, or [] when there is none."""
    path = [start]

    def walk(model: str, seen: set[str]) -> bool:
        for nxt in chains.get(model, ()):
            path.append(nxt)
            if nxt == start or (nxt not in seen and walk(nxt, seen | {nxt})):
                return True
            path.pop()
        return False

    return path if walk(start, {start}) else []


def _line(node: Node) -> int:
    return node.start_mark.line + 1

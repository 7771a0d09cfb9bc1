"""The mesh file of `splitserve up --config FILE.yaml`: several models, routes, fallbacks.

`load_mesh_config(path)` parses and checks the whole file and returns a frozen `MeshConfig`,
or raises `MeshConfigError` naming the file, the line and what is wrong: an unknown key, a
missing or ill-typed value, an unknown model in a route or fallback, a weight that is not
positive, a fallback cycle, a model with no workers and no upstream, a name used twice.
docs/mesh-config.example.yaml is the commented example; the shape:

    models:   [{name, model | model_dir | upstream, prefill, decode | aggregated, engine}]
    routes:   [{name, targets: [{model, weight, traffic}] | rules: [{max_prompt_tokens, model}]}]
    fallbacks: {model: [model, ...]}

Routes and fallbacks are parsed in services/mesh_routes.py; the YAML reads that keep each
value's line are services/mesh_yaml.py. A mesh model's workers report its `name` as their
model (heartbeats, block hashes), so the scheduler keeps each model's workers, queue and
prefix cache apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml
from yaml.nodes import Node

from services.mesh_routes import Route, parse_fallbacks, parse_route
from services.mesh_yaml import MeshConfigError, Reader
from services.worker.cli import NOT_ENGINE_FLAGS
from shared.engine.engine_config import EngineConfig
from shared.errors import ConfigError
from shared.flags import Setting, settings
from shared.models.registry import KNOWN_MODELS

# Set per worker by `up` (the model's directory), so not an `engine:` key.
ENGINE_SET_BY_UP = ("model_dir",)
DEFAULT_CONNECT_TIMEOUT_S = 2.0
DEFAULT_RESPONSE_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class Upstream:
    """An external OpenAI-compatible server (its base URL ends before /chat/completions)."""

    url: str  # e.g. http://host:8000/v1
    model: str  # the name it serves the model under
    api_key_env: str = ""  # an environment variable holding its bearer key; "": none
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S  # seconds to connect, then fall back
    response_timeout: float = DEFAULT_RESPONSE_TIMEOUT_S  # seconds until its response starts


@dataclass(frozen=True, slots=True)
class MeshModel:
    name: str  # the served name clients call and workers report
    line: int
    model: str = ""  # a known model name (pulled), or
    model_dir: Path | None = None  # an HF-layout directory, or
    upstream: Upstream | None = None  # an external server (no workers)
    prefill: int = 0  # workers of role prefill
    decode: int = 0  # workers of role decode
    aggregated: int = 0  # workers of role both (instead of prefill + decode)
    engine_argv: tuple[str, ...] = ()  # the `engine:` settings, as worker flags


@dataclass(frozen=True, slots=True)
class MeshConfig:
    source: Path
    models: tuple[MeshModel, ...]
    routes: tuple[Route, ...] = ()
    fallbacks: tuple[tuple[str, tuple[str, ...]], ...] = ()  # model -> models, in order

    def model(self, name: str) -> MeshModel:
        return next(m for m in self.models if m.name == name)

    @property
    def mesh_models(self) -> tuple[MeshModel, ...]:
        """The models served by workers of this mesh (not upstreams), in file order."""
        return tuple(m for m in self.models if m.upstream is None)

    def fallbacks_of(self, name: str) -> tuple[str, ...]:
        return dict(self.fallbacks).get(name, ())


def load_mesh_config(path: Path) -> MeshConfig:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise MeshConfigError(f"{path}: cannot read the mesh config: {exc.strerror}") from None
    reader = Reader(path)
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise MeshConfigError(f"{path}{line}: not valid YAML: {exc}") from None
    if root is None:
        raise MeshConfigError(f"{path}: the mesh config is empty; it needs `models:`")
    top = reader.mapping(
        root, "the mesh config", required=("models",), optional=("routes", "fallbacks")
    )
    models = tuple(_model(reader, n) for n in reader.sequence(top["models"], "models", min_len=1))
    names = _unique(reader, [(m.name, m.line) for m in models], "model")
    if all(m.upstream is not None for m in models):
        message = "models: at least one model needs workers (the gateway uses its tokenizer)"
        raise reader.error(top["models"], message)
    routes = tuple(parse_route(reader, n) for n in reader.sequence(top.get("routes"), "routes"))
    for route in routes:
        if route.name in names:
            raise reader.error_at(route.line, f"route {route.name!r} has the name of a model")
        for entry in (*route.targets, *route.rules):
            if entry.model not in names:
                message = f"route {route.name!r}: unknown model {entry.model!r}"
                raise reader.error_at(entry.line, message)
    _unique(reader, [(r.name, r.line) for r in routes], "route")
    fallbacks = parse_fallbacks(reader, top.get("fallbacks"), names)
    return MeshConfig(path, models, routes, fallbacks)


def _model(reader: Reader, node: Node) -> MeshModel:
    sources = ("model", "model_dir", "upstream")
    fields = reader.mapping(
        node,
        "a model",
        required=("name",),
        optional=(*sources, "upstream_model", "api_key_env", "connect_timeout",
                  "response_timeout", "prefill", "decode", "aggregated", "engine"),
    )  # fmt: skip
    name = reader.name(fields["name"], "name")
    given = [s for s in sources if s in fields]
    if len(given) != 1:
        raise reader.error(node, f"model {name!r} needs exactly one of {', '.join(sources)}")
    line = _line(node)
    if given == ["upstream"]:
        return MeshModel(name, line, upstream=_upstream(reader, fields, name))
    for key in ("upstream_model", "api_key_env", "connect_timeout", "response_timeout"):
        if key in fields:
            raise reader.error(fields[key], f"{key} is only for a model with an upstream")
    prefill, decode, aggregated = (
        reader.integer(fields[k], k, minimum=0) if k in fields else 0
        for k in ("prefill", "decode", "aggregated")
    )
    if aggregated and (prefill or decode):
        raise reader.error(node, f"model {name!r}: aggregated workers, or prefill + decode")
    if not aggregated and not decode:
        raise reader.error(
            node, f"model {name!r} has no workers: give it decode: N (and prefill: N), "
            "aggregated: N, or an upstream",
        )  # fmt: skip
    model_dir = None
    if "model_dir" in fields:  # relative to the config file's directory
        model_dir = reader.path.parent / Path(reader.text(fields["model_dir"], "model_dir"))
    known = reader.text(fields["model"], "model") if "model" in fields else ""
    if known and known not in KNOWN_MODELS:
        choices = ", ".join(sorted(KNOWN_MODELS))
        raise reader.error(fields["model"], f"unknown model {known!r} (known: {choices})")
    return MeshModel(
        name,
        line,
        model=known,
        model_dir=model_dir,
        prefill=prefill,
        decode=decode,
        aggregated=aggregated,
        engine_argv=_engine_argv(reader, fields.get("engine")),
    )


def _upstream(reader: Reader, fields: dict[str, Node], name: str) -> Upstream:
    for key in ("prefill", "decode", "aggregated", "engine"):
        if key in fields:
            raise reader.error(fields[key], f"model {name!r} has an upstream: no {key}")
    url = reader.text(fields["upstream"], "upstream")
    if not url.startswith(("http://", "https://")):
        raise reader.error(fields["upstream"], f"upstream must be an http(s) URL, not {url!r}")
    timeouts = {
        key: reader.number(fields[key], key, positive=True)
        for key in ("connect_timeout", "response_timeout")
        if key in fields
    }
    return Upstream(
        url.rstrip("/"),
        reader.text(fields["upstream_model"], "upstream_model")
        if "upstream_model" in fields
        else name,
        reader.text(fields["api_key_env"], "api_key_env") if "api_key_env" in fields else "",
        **timeouts,
    )


def _engine_argv(reader: Reader, node: Node | None) -> tuple[str, ...]:
    """`engine: {dtype: bfloat16, ...}` as worker flags, each key an engine flag's name."""
    if node is None:
        return ()
    known = {s.name: s for s in settings(EngineConfig, (*NOT_ENGINE_FLAGS, *ENGINE_SET_BY_UP))}
    fields = reader.mapping(node, "engine", optional=tuple(known), normalize=True)
    if "block_size" in fields:  # the scheduler hashes every model's blocks with one size
        message = "engine block_size is the whole mesh's: pass --block-size to up instead"
        raise reader.error(fields["block_size"], message)
    argv: list[str] = []
    for key, value_node in fields.items():
        argv += _flag(reader, known[key], value_node)
    return tuple(argv)


def _flag(reader: Reader, setting: Setting, node: Node) -> list[str]:
    value = reader.scalar(node, setting.name)
    if setting.kind is bool:
        if not isinstance(value, bool):
            raise reader.error(node, f"engine {setting.name} must be true or false")
        return [setting.option if value else "--no-" + setting.option[2:]]
    raw = ",".join(map(str, value)) if isinstance(value, list) else str(value)
    try:
        setting.parse(raw)
    except ConfigError as exc:
        raise reader.error(node, f"engine {setting.name}: {raw!r} is not valid: {exc}") from None
    return [setting.option, raw]


def _unique(reader: Reader, named: list[tuple[str, int]], what: str) -> set[str]:
    seen: set[str] = set()
    for name, line in named:
        if name in seen:
            raise reader.error_at(line, f"two {what}s are named {name!r}")
        seen.add(name)
    return seen


def _line(node: Node) -> int:
    return node.start_mark.line + 1


def model_dir_of(model: MeshModel, home: Path) -> Path:
    """Where a mesh model's weights are: its model_dir, or where `pull` puts a known model."""
    return model.model_dir if model.model_dir is not None else home / "models" / model.model

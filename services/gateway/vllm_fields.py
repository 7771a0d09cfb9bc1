"""vLLM's request fields that are not sampling parameters: the refused ones, beam search.

REFUSED: fields vLLM documents that this server does not do; set to anything but their
default they are a 400 saying why (docs/API.md, the strictness rule). `beam_search`
checks `use_beam_search` against what beam search cannot be combined with.
"""

from __future__ import annotations

from typing import Any

from services.gateway.body_fields import bool_field
from services.gateway.errors import invalid
from services.gateway.structured import GUIDED_FIELDS
from services.gateway.tools import ToolRequest
from shared.engine.sampling_params import MAX_TOP_LOGPROBS

MAX_BEAMS = MAX_TOP_LOGPROBS // 2  # each step asks 2 * width logprobs (beam_search.py)
REFUSED: dict[str, tuple[Any, str]] = {
    "cache_salt": ("", "the prefix cache is shared by all requests of a model"),
    "best_of": (1, "use n; choices are not ranked"),
}


def beam_search(body: dict[str, Any], n: int, tools: ToolRequest | None) -> bool:
    """use_beam_search, checked against what beam search cannot do (400 naming the field)."""
    if not bool_field(body, "use_beam_search", False):
        if "length_penalty" in body and body["length_penalty"] != 1.0:
            raise invalid("length_penalty needs use_beam_search", "length_penalty")
        return False
    if n > MAX_BEAMS:
        raise invalid(f"n (the beam width) must be <= {MAX_BEAMS} with beam search", "n")
    conflicts = [
        *(f for f in ("stream", "echo", "logprobs", "prompt_logprobs", "suffix") if body.get(f)),
        *(f for f in ("stop", *GUIDED_FIELDS) if body.get(f)),
    ]
    if tools is not None and tools.active:
        conflicts.append("tools")
    if conflicts:
        raise invalid(f"beam search does not take {conflicts[0]}", conflicts[0])
    return True


def refuse(body: dict[str, Any]) -> None:
    """400 for a REFUSED field set to anything but its default."""
    for name, (default, why) in REFUSED.items():
        if name in body and body[name] != default:
            raise invalid(f"{name} is not supported: {why}", name)
    for name in REFUSED:
        body.pop(name, None)

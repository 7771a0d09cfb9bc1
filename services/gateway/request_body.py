"""A generation request's body, read once and shared by the router and the handler.

`RequestBody.read` decodes the JSON once. The body is validated (`parsed`) only when a
mesh model serves it or a route's rule counts its prompt; an upstream gets it as sent, so
a field only the upstream knows still reaches it. The prompt is tokenized once per model
(`prompt_ids`), so the count a route's rule asks for is the tokenization the serving model
then submits when they share a tokenizer.
Subtle rule: `parsed` is validated against the OpenAI defaults; a model's own sampling
defaults are applied per model (`for_model`), never by parsing again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from services.gateway.errors import invalid
from services.gateway.limits import tenant_of
from services.gateway.openai_schema import GenerationRequest, Kind, parse_request, with_defaults
from services.gateway.prompting import ModelText


async def json_body(request: web.Request) -> Any:
    """The JSON body; 400 when it is not JSON."""
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise invalid("the request body is not valid JSON") from None


@dataclass(slots=True)
class RequestBody:
    kind: Kind
    json: Any  # as the client sent it; None when it is not JSON
    tenant: str = ""  # the caller's, for fair service (limits.tenant_of)
    _parsed: GenerationRequest | None = field(default=None, init=False, repr=False)
    # the prompt's token ids, by the model that tokenized it
    _prompt_ids: dict[str, list[int]] = field(default_factory=dict, init=False, repr=False)

    @classmethod
    async def read(cls, request: web.Request, kind: Kind) -> RequestBody:
        try:
            return cls(kind, await request.json(), tenant_of(request))
        except (json.JSONDecodeError, UnicodeDecodeError):
            return cls(kind, None, tenant_of(request))

    @property
    def model(self) -> str | None:
        """The `model` the client called, when the body names one."""
        called = self.json.get("model") if isinstance(self.json, dict) else None
        return called if isinstance(called, str) else None

    def parsed(self) -> GenerationRequest:
        """The validated request (400 naming the first bad field), with OpenAI's defaults."""
        if self._parsed is None:
            if self.json is None:
                raise invalid("the request body is not valid JSON")
            self._parsed = parse_request(self.kind, self.json)
        return self._parsed

    def for_model(self, text: ModelText) -> GenerationRequest:
        """The validated request with the model's own sampling defaults."""
        return with_defaults(self.parsed(), text.sampling_defaults)

    def prompt_ids(self, model: str, text: ModelText) -> list[int]:
        """The prompt as `model` (whose text is `text`) submits it."""
        ids = self._prompt_ids.get(model)
        if ids is None:
            parsed = self.parsed()
            if parsed.messages is not None:
                ids = text.chat_prompt_ids(parsed.messages, parsed.tools, parsed.chat)
            else:
                assert parsed.prompt is not None  # parse_request sets one of the two
                ids = text.completion_prompt_ids(parsed.prompt, parsed.suffix)
            self._prompt_ids[model] = ids
        return ids

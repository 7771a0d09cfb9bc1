"""The gateway passes each request's tenant and `priority` to the scheduler (fair service,
services/scheduler/fair_share.py): the tenant is an id derived from the caller's API key —
the same for the same key, another for another key, never the key itself — and `priority`
is vLLM's integer (a non-integer is a 400 naming it). Harness: gateway_harness.py."""

from __future__ import annotations

import hashlib

import openai
import pytest

from tests.e2e.conftest import real_model_dir  # noqa: F401  (fixture)
from tests.integration.gateway_harness import (
    KEY,
    MESSAGES,
    MODEL,
    Harness,
    gw_fixture,  # noqa: F401  (fixtures)
)

pytestmark = pytest.mark.e2e


def test_tenant_and_priority_reach_the_scheduler(gw: Harness) -> None:
    gw.reply_script()
    gw.client().chat.completions.create(model=MODEL, messages=MESSAGES, extra_body={"priority": -3})
    first = gw.mesh.submitted[-1]
    gw.reply_script()
    gw.client(api_key="other-key").completions.create(model=MODEL, prompt="hi", max_tokens=2)
    other = gw.mesh.submitted[-1]
    assert first.priority == -3 and other.priority == 0
    assert first.tenant == "key-" + hashlib.sha256(KEY.encode()).hexdigest()[:16]
    assert other.tenant.startswith("key-") and other.tenant != first.tenant
    assert KEY not in first.tenant and "other-key" not in other.tenant
    with pytest.raises(openai.BadRequestError) as info:
        gw.client().chat.completions.create(
            model=MODEL, messages=MESSAGES, extra_body={"priority": "urgent"}
        )
    assert info.value.body["param"] == "priority"

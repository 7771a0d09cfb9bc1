"""Fair service between tenants when requests wait: virtual token counters (VTC, as in
"Fairness in Serving Large Language Models", Sheng et al., OSDI 2024).

- A tenant is the caller behind a request: the id the gateway derives from its API key
  (`SubmitRequest.tenant`; "" for callers without one, who share one counter).
- Each tenant's counter adds the tokens of every request of it the scheduler places (placed
  at once or after waiting): its prompt plus its output budget (max_tokens). They are booked
  when placed, since the scheduler does not see tokens stream; a long generation counts
  before it runs, so a tenant cannot jump the line with a few huge requests.
- Waiting requests get their turns in order of `priority` (vLLM's: lower first), then their
  tenant's counter (lowest first), then arrival. Counters move as requests are placed, so
  the order is taken afresh at every turn.
- The subtle rule: a tenant that becomes active (a request of it waits, none did) has its
  counter lifted to the lowest counter of the tenants active then, so time spent idle is
  not saved up as credit to flood with later; a tenant never loses what it has used.
"""

from __future__ import annotations

from dataclasses import dataclass, field

Key = tuple[int, float]  # (priority, the tenant's counter): lower is served first


@dataclass(slots=True)
class FairShare:
    counters: dict[str, float] = field(default_factory=dict)  # tenant → tokens booked
    waiting: dict[str, int] = field(default_factory=dict)  # tenant → its waiters, all lines

    def key(self, priority: int, tenant: str) -> Key:
        return priority, self.counters.get(tenant, 0.0)

    def joined(self, tenant: str) -> None:
        """A request of `tenant` waits now: lift its counter if it was not active."""
        if not self.waiting.get(tenant):
            self.counters[tenant] = self.lifted(tenant)
        self.waiting[tenant] = self.waiting.get(tenant, 0) + 1

    def left(self, tenant: str) -> None:
        self.waiting[tenant] -= 1
        if not self.waiting[tenant]:
            del self.waiting[tenant]

    def lifted(self, tenant: str) -> float:
        """`tenant`'s counter as it would be on becoming active now."""
        own = self.counters.get(tenant, 0.0)
        active = [self.counters.get(t, 0.0) for t in self.waiting if t != tenant]
        return max(own, min(active)) if active else own

    def charge(self, tenant: str, tokens: int) -> None:
        """A request of `tenant` was placed: its tokens count as served."""
        self.counters[tenant] = self.counters.get(tenant, 0.0) + tokens

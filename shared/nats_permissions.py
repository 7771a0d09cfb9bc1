"""What each role may publish and subscribe to on NATS: DESIGN.md's subject table, per role.

Every role may also subscribe to its own reply inbox (`_INBOX.<role>.>`, the prefix its
connection uses: shared/nats_options.py) and answer the requests it receives (NATS's
`allow_responses`), and nothing else. Subjects are built by `shared.subjects.Subjects`
with `*` in place of a worker's or gateway's id, so the table cannot drift from it.

role       publishes                                   subscribes to
gateway    sched.submit, sched.status, cancel          gateway.*.tokens, events
scheduler  worker.*.reserve|prefill|decode,            sched.submit, sched.status,
           events, cancel                              workers.heartbeat, kv.events, cancel
prefill    workers.heartbeat, kv.events,               worker.*.prefill, cancel, events
           gateway.*.tokens, worker.*.kv
decode     workers.heartbeat, kv.events,               worker.*.reserve|decode|kv,
           gateway.*.tokens                            cancel, events
both       prefill's and decode's                      prefill's and decode's
observer   sched.status (the mesh view, tools, tests)  nothing
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.nats_options import INBOX_ROOT
from shared.subjects import Subjects

ROLES = ("gateway", "scheduler", "prefill", "decode", "both", "observer")
_ID = "ID"  # stands for any worker or gateway id while the table is built


@dataclass(frozen=True, slots=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]

    def __or__(self, other: Permissions) -> Permissions:
        return Permissions(
            _unique(self.publish + other.publish), _unique(self.subscribe + other.subscribe)
        )


def role_permissions(role: str, subjects: Subjects) -> Permissions:
    """The subjects `role` may use under `subjects.namespace`, its reply inbox included."""
    if role not in ROLES:
        raise ValueError(f"unknown NATS role {role!r}; one of {ROLES}")
    s = subjects

    def any_id(build) -> str:  # ss.worker.ID.kv -> ss.worker.*.kv
        return build(_ID).replace(f".{_ID}.", ".*.")

    workers_report = (s.heartbeat, s.kv_events, any_id(s.tokens))
    table = {
        "gateway": Permissions((s.submit, s.status, s.cancel), (any_id(s.tokens), s.events)),
        "scheduler": Permissions(
            (any_id(s.reserve), any_id(s.prefill), any_id(s.decode), s.events, s.cancel),
            (s.submit, s.status, s.heartbeat, s.kv_events, s.cancel),
        ),
        "prefill": Permissions(
            (*workers_report, any_id(s.kv)), (any_id(s.prefill), s.cancel, s.events)
        ),
        "decode": Permissions(
            workers_report,
            (any_id(s.reserve), any_id(s.decode), any_id(s.kv), s.cancel, s.events),
        ),
        "observer": Permissions((s.status,), ()),
    }
    table["both"] = table["prefill"] | table["decode"]
    own = table[role]
    return Permissions(own.publish, (*own.subscribe, f"{INBOX_ROOT}.{role}.>"))


def _unique(items: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(items))

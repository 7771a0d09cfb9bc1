"""What each role may publish and subscribe to on NATS: DESIGN.md's subject table, per role.

Every role may also subscribe to its own reply inbox (`_INBOX.<role>.>`, the prefix its
connection uses: shared/nats_options.py) and answer the requests it receives (NATS's
`allow_responses`), and nothing else. Subjects are built by `shared.subjects.Subjects`
with `*` in place of a worker's or gateway's id, so the table cannot drift from it.

role       publishes                                   subscribes to
gateway    sched.submit, sched.status, sched.adapters, gateway.*.tokens, events
           cancel, worker.*.sleep
scheduler  worker.*.reserve|prefill|decode|role|       sched.submit, sched.status,
           adapters|probe, events, cancel              sched.adapters, workers.heartbeat,
                                                       kv.events, cancel, planner.report
prefill    workers.heartbeat, kv.events,               worker.*.prefill|role|adapters|probe|
           gateway.*.tokens, worker.*.kv|prefix        sleep|prefix, cancel, events
decode     workers.heartbeat, kv.events,               worker.*.reserve|decode|kv|role|
           gateway.*.tokens, worker.*.prefix           adapters|probe|sleep|prefix, cancel, events
both       prefill's and decode's                      prefill's and decode's
planner    worker.*.role, pool.target, planner.report, workers.heartbeat
           sched.status
launcher   sched.status (which workers are registered)  pool.target
observer   sched.status (the mesh view, tools, tests)  nothing

`worker.*.prefix` is worker to worker: a worker asks another to pin prefix blocks it will READ
(shared/prefix_messages.py), so every worker role both sends and answers it.
`worker.*.sleep` (sleep and wake-up, vLLM's /sleep and /wake_up) is the gateway's to send.
`worker.*.role` (SetRole) is the scheduler's and the planner's to send (`splitserve role`
connects with the scheduler's credentials, `splitserve scale` with the planner's). A worker
may serve only the roles its NATS user permits (`may_serve`): one that changes role while
serving connects as `both`.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.nats_options import INBOX_ROOT
from shared.subjects import Subjects

ROLES = ("gateway", "scheduler", "prefill", "decode", "both", "planner", "launcher", "observer")
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
    own = _table(subjects)[role]
    return Permissions(own.publish, (*own.subscribe, f"{INBOX_ROOT}.{role}.>"))


def may_serve(nats_user: str, role: str, subjects: Subjects) -> bool:
    """Do the permissions of NATS user `nats_user` cover worker role `role`'s subjects? A user
    outside ROLES (anonymous: "", or one this module did not write) is not second-guessed."""
    if nats_user not in ROLES:
        return True
    table = _table(subjects)
    have, need = table[nats_user], table[role]
    return set(need.publish) <= set(have.publish) and set(need.subscribe) <= set(have.subscribe)


def _table(subjects: Subjects) -> dict[str, Permissions]:
    """Each role's subjects, without its reply inbox."""
    s = subjects

    def any_id(build) -> str:  # ss.worker.ID.kv -> ss.worker.*.kv
        return build(_ID).replace(f".{_ID}.", ".*.")

    workers_report = (s.heartbeat, s.kv_events, any_id(s.tokens), any_id(s.prefix))
    workers_hear = (
        *(any_id(s.role), any_id(s.worker_adapters), any_id(s.probe), any_id(s.sleep)),
        *(s.cancel, s.events, any_id(s.prefix)),
    )
    to_workers = (
        *(any_id(s.reserve), any_id(s.prefill), any_id(s.decode)),
        *(any_id(s.role), any_id(s.worker_adapters), any_id(s.probe)),
    )
    table = {
        "gateway": Permissions(
            (s.submit, s.status, s.cancel, s.adapters, any_id(s.sleep)),
            (any_id(s.tokens), s.events),
        ),
        "scheduler": Permissions(
            (*to_workers, s.events, s.cancel),
            (s.submit, s.status, s.heartbeat, s.kv_events, s.cancel, s.planner_report, s.adapters),
        ),
        "prefill": Permissions((*workers_report, any_id(s.kv)), (any_id(s.prefill), *workers_hear)),
        "decode": Permissions(
            workers_report, (any_id(s.reserve), any_id(s.decode), any_id(s.kv), *workers_hear)
        ),
        "planner": Permissions(
            (any_id(s.role), s.pool_target, s.planner_report, s.status), (s.heartbeat,)
        ),
        "launcher": Permissions((s.status,), (s.pool_target,)),
        "observer": Permissions((s.status,), ()),
    }
    table["both"] = table["prefill"] | table["decode"]
    return table


def _unique(items: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(items))

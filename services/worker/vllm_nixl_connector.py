"""vLLM's NixlConnector as our vLLM workers run it: its NIXL progress thread waits for work.

NIXL's Python API starts the UCX backend's progress thread with a delay of 0 (nixl_cu13
`nixl_agent.__init__`: `agent_config.pthrDelay = 0`), so the thread calls epoll_wait with
a timeout of 0 in a loop: an idle vLLM worker spent 55-107 % of a core on it (2-core box),
and under load it takes that core from the engines. vLLM's connector wants the thread (a
peer's READ and its notifications make progress through it: without the thread, the first
READ of a request stalled until its lease ran out) and has no option for its delay. Here
the delay becomes PROGRESS_DELAY_US: the thread sleeps on UCX's event fd for up to that
long, waking at once when UCX signals work.

vLLM loads this module as the connector's `kv_connector_module_path` in its engine
process; the connector keeps its name, `NixlConnector`, which vLLM's platform and config
checks look for. The one subtle rule: the agent config class is replaced in the bindings
module before vLLM's first agent is built, which importing this module does.
"""

from __future__ import annotations

import sys

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector, base_worker

__all__ = ["NixlConnector"]
PROGRESS_DELAY_US = 1000


def _delay_progress_thread() -> None:
    agent_class = base_worker.NixlWrapper
    if agent_class is None:  # no NIXL here: vLLM says so when the connector starts
        return
    bindings = sys.modules[agent_class.__module__].nixlBind
    config_class = bindings.nixlAgentConfig
    if getattr(config_class, "splitserve_delayed", False):
        return
    delay = config_class.pthrDelay

    class DelayedConfig(config_class):
        splitserve_delayed = True

        @property
        def pthrDelay(self) -> int:
            return delay.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, value: int) -> None:
            delay.__set__(self, max(value, PROGRESS_DELAY_US))

    bindings.nixlAgentConfig = DelayedConfig


_delay_progress_thread()

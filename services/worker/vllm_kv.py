"""`VllmKV`: the `EngineKV` of a vLLM worker, whose KV moves through vLLM's NixlConnector.

vLLM keeps the blocks itself (vllm_transport.py says how the connector fits the mesh's
one-sided hand-off), so this object keeps only what the mesh checks and forwards:
- prefill: a held prompt's `kv_transfer_params` (where its blocks are), which `params`
  gives the mesh to send in `KVReady.engine_params`. vLLM keeps the blocks until the decode
  engine has READ them (or its lease passes), so `release` has nothing to free.
- decode: a reservation holds no vLLM blocks (vLLM allocates them when the request enters
  it), only the prompt's block hashes to check an offer against; `start_decode` submits the
  request with the prefill engine's params and `do_remote_prefill`.
It has no `copier`: a vLLM worker takes KV by its connector only.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import torch

from shared.engine.block_hash import block_hashes
from shared.engine.errors import InvalidRequest, UnknownRequest
from shared.engine.kv_handoff import HeldBlocks, Reservation, check_offered
from shared.kvtransfer.transfer import KVCopier
from shared.protocol import SubmitRequest

# (request, vLLM's kv_transfer_params, the first token the prefill worker streamed)
StartDecode = Callable[[SubmitRequest, dict[str, object], int], None]


@dataclass(slots=True)
class _Reserved:
    request: SubmitRequest
    block_hashes: list[int | None]  # one per block of the prompt


class VllmKV:
    def __init__(
        self,
        block_size: int,
        model_id: str,
        check: Callable[[SubmitRequest], None],
        start: StartDecode,
        fail: Callable[[str, BaseException], None],
    ) -> None:
        """`check` raises InvalidRequest for a request vLLM would refuse; `start` runs a
        decode in vLLM; `fail` reports a request's failure from the loop."""
        self.block_size = block_size
        self.model_id = model_id
        self._check = check
        self._start = start
        self._fail = fail
        self.held_params: dict[str, dict[str, object]] = {}  # prefill: vLLM's, per request
        self.reservations: dict[str, _Reserved] = {}

    @property
    def copier(self) -> KVCopier | None:
        return None

    @property
    def peer_blocks(self) -> None:
        return None  # vLLM's prefix cache is its own: no reads of prefixes between workers

    def cache_layers(self) -> list[torch.Tensor]:
        return []  # registered with NIXL by vLLM's connector, not by the worker

    def hashes(self, request: SubmitRequest, num_blocks: int) -> list[int | None]:
        tokens = [*request.prompt_token_ids, *request.delivered_token_ids]
        return block_hashes(tokens, self.block_size, self.model_id, num_blocks)

    async def reserve(self, request: SubmitRequest) -> Reservation:
        self._check(request)
        num_tokens = len(request.prompt_token_ids) + len(request.delivered_token_ids)
        num_blocks = -(-num_tokens // self.block_size)
        self.reservations[request.request_id] = _Reserved(request, self.hashes(request, num_blocks))
        return Reservation(list(range(num_blocks)), 0)  # vLLM finds its own cached prefix

    def hold(self, request: SubmitRequest, block_ids: list[int], params: dict) -> HeldBlocks:
        """A prefill's first token is out and vLLM keeps its blocks for the decode engine."""
        self.held_params[request.request_id] = dict(params)
        return HeldBlocks(block_ids, self.hashes(request, len(block_ids)))

    def reserved(
        self, request_id: str, first_block: int, block_hashes: list[int | None]
    ) -> list[int]:
        reserved = self.reservations.get(request_id)
        if reserved is None:
            raise UnknownRequest(f"no reservation for {request_id!r}")
        hashes = reserved.block_hashes
        indices = check_offered(request_id, len(hashes), hashes, first_block, block_hashes)
        return list(indices)  # a reservation's block ids are its table positions

    def params(self, request_id: str) -> bytes:
        params = self.held_params.get(request_id)
        if params is None:
            raise UnknownRequest(f"request {request_id!r} holds no blocks here")
        return json.dumps(params).encode()

    @contextlib.asynccontextmanager
    async def pinned(self, request_id: str) -> AsyncIterator[None]:
        """vLLM pins the blocks it READs into, and those it is READ from, by itself."""
        yield

    def release(self, request_id: str) -> None:
        self.held_params.pop(request_id, None)  # the decode engine READ them: vLLM frees them

    def forget(self, request_id: str) -> None:
        self.held_params.pop(request_id, None)  # vLLM frees held blocks when their lease ends
        self.reservations.pop(request_id, None)

    def start_decode(self, request_id: str, first_token_id: int, engine_params: bytes) -> None:
        reserved = self.reservations.pop(request_id, None)
        if reserved is None:
            self._fail(request_id, UnknownRequest(f"no reservation for {request_id!r}"))
            return
        try:
            params = json.loads(engine_params) if engine_params else {}
        except json.JSONDecodeError as exc:
            self._fail(request_id, InvalidRequest("engine_params", str(exc)))
            return
        if not params:
            self._fail(request_id, InvalidRequest("engine_params", "no kv_transfer_params"))
            return
        params.update(do_remote_prefill=True, do_remote_decode=False)
        self._start(reserved.request, params, first_token_id)

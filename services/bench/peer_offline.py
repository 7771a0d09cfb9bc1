"""Offline engine throughput: our engine in this process against vLLM's `LLM.generate`.

Both get the same random token-id prompts, all at once, greedy with ignore_eos, and are
timed from the first request in to the last token out (prefill included). vLLM runs in the
peers' venv as a subprocess (services/bench/vllm_offline.py), with a deadline.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from services.bench.deadline_run import run_to_log

VLLM_OFFLINE_SCRIPT = Path(__file__).with_name("vllm_offline.py")


@dataclass(frozen=True, slots=True)
class OfflineConfig:
    num_prompts: int = 64
    input_len: int = 128
    output_len: int = 128
    engine_dtype: str | None = None  # None: the engine's default
    timeout_s: float = 1200.0  # vLLM's side: its import, start-up (a compile) and the run


@dataclass(frozen=True, slots=True)
class OfflineResult:
    ours_tok_s: float  # our engine's output tok/s
    vllm_tok_s: float  # vLLM LLM.generate's output tok/s

    @property
    def ratio(self) -> float:
        return self.ours_tok_s / self.vllm_tok_s

    def line(self) -> str:
        return (
            f"offline output tok/s: splitserve engine {self.ours_tok_s:.1f}, vLLM LLM.generate "
            f"{self.vllm_tok_s:.1f}, ratio {self.ratio:.2f}x"
        )


def ours_offline(model_dir: Path, prompts: list[list[int]], cfg: OfflineConfig) -> float:
    """Output tok/s of our engine (services/bench/engine.py's measure, after a warm-up)."""
    from services.bench.engine import engine_offline, engine_single_stream
    from shared.engine.engine import LLMEngine
    from shared.engine.engine_config import EngineConfig

    dtype = {"dtype": cfg.engine_dtype} if cfg.engine_dtype else {}
    engine = LLMEngine(EngineConfig(model_dir=model_dir, device="cpu", **dtype))
    engine_single_stream(engine, prompts[0][:16], 8)
    return engine_offline(engine, prompts, cfg.output_len)


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
    prompts: list[list[int]],
    cfg: OfflineConfig,
    env: dict[str, str],
    log_path: Path,
) -> float:
    """Output tok/s of vLLM's offline LLM.generate on the same prompts."""
    with tempfile.TemporaryDirectory(prefix="vllm-offline-") as scratch:
        prompts_file, out = Path(scratch) / "prompts.json", Path(scratch) / "result.json"
        prompts_file.write_text(json.dumps(prompts))
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
        return float(json.loads(out.read_text())["output_tok_s"])

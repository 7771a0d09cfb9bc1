"""A worker's start imports only what every request needs: xgrammar (and the transformers it
imports) waits for the first guided request, the gguf package for a GGUF checkpoint's pull;
together they were ~3 of a quiet start's ~6.5 s of imports (docs/start.md). Started as `up`
starts it (`python -m services.cli worker ...`), the command line imports only the worker's
parser: not the benchmarks' (matplotlib) nor the model pull's (gguf, mistral_common)."""

from __future__ import annotations

import subprocess
import sys

DEFERRED = ("xgrammar", "transformers", "gguf", "mistral_common")
OTHER_COMMANDS = ("matplotlib", "loadtest", "services.gateway", "services.launcher")


def imported_after(code: str, modules: tuple[str, ...]) -> str:
    """Which of `modules` a fresh interpreter has imported after running `code` (comma-joined)."""
    probe = f"import sys;{code};print(','.join(m for m in {modules!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_the_worker_runtime_imports_none_of_the_deferred_packages():
    assert imported_after("import services.worker.runtime", DEFERRED) == ""


def test_the_worker_command_line_imports_no_other_command_s_modules():
    code = (
        "import services.cli as cli, services.worker.runtime;"
        "args = cli.build_parser('worker').parse_args(['worker', '--model-dir', '/m']);"
        "assert args.func.__module__ == 'services.worker.cli', args.func"
    )
    assert imported_after(code, (*DEFERRED, *OTHER_COMMANDS)) == ""


def test_the_whole_parser_still_has_every_command_and_one_command_s_only_it():
    from services.cli import COMMANDS, build_parser

    assert "{" + ",".join(COMMANDS) + "}" in build_parser().format_help()
    assert "{worker}" in build_parser("worker").format_help()

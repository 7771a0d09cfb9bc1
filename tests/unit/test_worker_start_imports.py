"""A worker's start imports only what every request needs: xgrammar (and the transformers it
imports) waits for the first guided request, the gguf package for a GGUF checkpoint's pull;
together they were ~3 of a quiet start's ~6.5 s of imports (docs/start.md)."""

from __future__ import annotations

import subprocess
import sys

DEFERRED = ("xgrammar", "transformers", "gguf", "mistral_common")


def test_the_worker_runtime_imports_none_of_the_deferred_packages():
    probe = (
        "import sys, services.worker.runtime;"
        f"print(','.join(m for m in {DEFERRED!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""

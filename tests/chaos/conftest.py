"""Fixtures of the chaos cases (issue 60): the e2e ones (the real tokenizer's tiny mesh
model), and the `chaos` marker's meaning: a case too long for `make test`, run by
`make chaos`."""

from __future__ import annotations

from tests.e2e.conftest import real_model_dir  # noqa: F401 (a fixture)

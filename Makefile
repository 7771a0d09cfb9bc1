# The two commands a newcomer runs: `make up` and `make test`. Everything lives in .venv.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
MODEL ?= smollm2-135m-instruct

.PHONY: install pull up test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# The CPU build of torch first; pyproject's range then keeps pip from swapping it out.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

install: $(STAMP)

pull: install
	$(VENV)/bin/splitserve pull $(MODEL)

# Until the mesh lands (gateway, scheduler, workers), `up` answers one chat prompt with the
# engine on the real model, so the whole model path is exercised end to end.
up: pull
	$(VENV)/bin/splitserve generate --model $(MODEL) "What is the capital of France?"

lint: install
	$(VENV)/bin/ruff check .

test: install lint
	$(VENV)/bin/pytest

bench: pull
	$(VENV)/bin/splitserve bench engine --model $(MODEL)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache

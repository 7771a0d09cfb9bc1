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

# The whole mesh on this machine: embedded nats-server, scheduler, gateway on :8000,
# one prefill and one decode worker. Ctrl-C stops everything in order.
up: pull
	$(VENV)/bin/splitserve up --model $(MODEL)

lint: install
	$(VENV)/bin/ruff check .

test: install lint
	$(VENV)/bin/pytest

bench: pull
	$(VENV)/bin/splitserve bench engine --model $(MODEL)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache

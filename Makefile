# The two commands a newcomer runs: `make up` and `make test`. Everything lives in .venv.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
NATIVE_STAMP := $(VENV)/.native-stamp
MODEL ?= smollm2-135m-instruct

.PHONY: install pull up test lint bench bench-peers clean

# The images (compose/Dockerfile*) run this same recipe: `make install VENV=/opt/splitserve
# INSTALL_SPEC=. TORCH_INDEX=<their torch build's index>`.
TORCH_INDEX ?=
INSTALL_SPEC ?= -e '.[dev]'

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# The CPU build of torch first; pyproject's range then keeps pip from swapping it out.
	$(PY) -m pip install --quiet $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) torch==2.13.0
	$(PY) -m pip install --quiet $(INSTALL_SPEC)
	touch $@

# The C++ kernels: rebuilt when csrc/cpu changes (ninja recompiles only what changed).
$(NATIVE_STAMP): $(STAMP) $(wildcard csrc/cpu/*)
	$(PY) -m shared.engine.native
	touch $@

install: $(NATIVE_STAMP)

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

# The engine alone, then the serving matrix through `splitserve up` (disaggregated and
# aggregated, concurrency 1-16, plus a shared-prefix pair); results in artifacts/loadtest/.
bench: pull
	$(VENV)/bin/splitserve bench engine --model $(MODEL)
	$(VENV)/bin/splitserve bench matrix --model $(MODEL)

# `splitserve up` beside vLLM-CPU (and llama.cpp's llama-server when it builds), taking turns
# in one run, then offline engine throughput; results in artifacts/bench-peers/. The peers
# live in their own venv (PEERS_VENV), set up on the first run and reused while current.
# Extra options: `make bench-peers PEERS_ARGS="--rounds 3 -- --dtype bfloat16"`.
PEERS_VENV ?= .venv-peers
PEERS_ARGS ?=
bench-peers: pull
	$(VENV)/bin/splitserve bench peers --model $(MODEL) --peers-venv $(PEERS_VENV) $(PEERS_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache

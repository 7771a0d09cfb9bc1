"""LoRA adapters on the native engine: PEFT checkpoints served beside the base model, each row
of a batch multiplied by its own adapter.

In order: `modules.py` parses `--lora-modules name=path` (pure, for EngineConfig);
`checkpoint.py` reads and checks a PEFT directory into our fused layout (`AdapterWeights`);
`bank.py` keeps the known adapters, a host cache of read ones (`max_cpu_loras`, LRU) and the
slots the matmuls read (`max_loras`, LRU); `stacked.py` holds every slot's share of one
fused matrix and adds a whole step's low-rank products in one call (csrc/cpu/
lora_products.cpp); `step_rows.py` gives each row its slot; `linear.py` wraps a layer's
matrices so that `model/decoder.linear` adds them. docs/lora.md says more.
"""

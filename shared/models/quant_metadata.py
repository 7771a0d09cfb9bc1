"""The safetensors metadata key under which a converted checkpoint lists its quantized
tensors (JSON: HF name -> QuantArrays.params(), shared/models/gguf_quant.py).

The one subtle rule: this module imports nothing, so a worker that reads a checkpoint's
metadata does not import the gguf package (seconds of a start) to learn the key.
"""

QUANT_METADATA = "splitserve.quantized"

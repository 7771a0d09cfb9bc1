"""The packed-weight cache: `batch_invariant.pack_weights`' result on disk, mapped at the
next start instead of loading and packing the checkpoint again.

One file per (checkpoint, key) under `<SPLITSERVE_HOME>/packed/`. The key: a digest of the
checkpoint's files (each file's name, size, mtime and safetensors header: shapes, dtypes
and offsets of every tensor), PACK_LAYOUT (the Python side of the packing: PackedGateUp's
panel pairs), the C++ kernels' source digest (shared/engine/native.py: their packing, their
flags, torch's version), this CPU's kernel features, the dtype and silu_mlp. The file:

    MAGIC, the header's length (u64, little-endian), the header (JSON: the key, the file's
    size, each tensor's dtype, shape and offset, and the weights' tree), zeros up to ALIGN,
    then each tensor at its offset (a multiple of ALIGN).

`load` maps it (torch.from_file, private: the pages are the page cache's, one copy for every
worker of the host, and nothing written reaches the file) and rebuilds the weights; it
returns None, saying why, when the file is missing, was made for another key, is not the
size its header says (truncated), or cannot be read; the caller packs afresh and `store`s
(to a temporary name, then renamed: a reader never sees half a file).
The subtle rule: only the types in TREE_TYPES are cached; weights holding anything else
(a matrix kept quantized, MoE experts) are not, and pack at every start.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import struct
import tempfile
from pathlib import Path
from typing import Any

import torch

from shared.engine import native
from shared.engine.model.checkpoint import checkpoint_files
from shared.engine.model.linear_weights import PackedGateUp, PackedLinear
from shared.engine.model.weights import LayerWeights, ModelWeights

log = logging.getLogger(__name__)
MAGIC = b"SSPACK\x00\x01"
ALIGN = 4096  # each tensor on its own page boundary (a multiple of every kernel's need)
PACK_LAYOUT = 1  # bump when the Python side of the packing changes
MAX_HEADER = 64 * 2**20  # a longer one is not a header of ours
TREE_TYPES: dict[str, type] = {
    cls.__name__: cls for cls in (ModelWeights, LayerWeights, PackedLinear, PackedGateUp)
}
DTYPES: dict[str, torch.dtype] = {
    str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.int32)
}


class NotCacheable(ValueError):
    """The weights hold a type the cache does not write."""


def cache_home() -> Path:
    """`$SPLITSERVE_HOME/packed` (the home as shared/models/pull.py's default_home says)."""
    home = os.environ.get("SPLITSERVE_HOME")
    return (Path(home) if home else Path.home() / ".cache" / "splitserve") / "packed"


def cache_key(model_dir: Path, dtype: torch.dtype, silu_mlp: bool) -> str:
    """The digest a cache file must carry to be used for this checkpoint, here."""
    kernels = native.load()
    features = ",".join(kernels.cpu_features()) + f";amx={kernels.amx_tiles()}" if kernels else ""
    digest = hashlib.sha256(
        f"{PACK_LAYOUT}|{native.source_digest()}|{features}|{dtype}|{silu_mlp}".encode()
    )
    for path in checkpoint_files(model_dir):
        stat = path.stat()
        digest.update(f"\0{path.name}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
        with path.open("rb") as file:  # the safetensors header: every tensor's place
            (length,) = struct.unpack("<Q", file.read(8))
            digest.update(file.read(min(length, 100 * 2**20)))
    return digest.hexdigest()


def cache_path(model_dir: Path, home: Path | None = None) -> Path:
    """Where the packed weights of the checkpoint in `model_dir` are kept."""
    resolved = model_dir.resolve()
    name = hashlib.sha256(str(resolved).encode()).hexdigest()[:16]
    return (home or cache_home()) / f"{resolved.name}-{name}.pack"


def store(weights: ModelWeights, path: Path, key: str) -> int:
    """Write the packed weights to `path` for `key`; its size in bytes. NotCacheable when
    they hold a type the cache does not write (nothing is written then)."""
    tensors: list[torch.Tensor] = []
    tree = _tree(weights, tensors, {}, {})
    entries, offset = [], 0
    for tensor in tensors:
        entries.append({"dtype": str(tensor.dtype), "shape": list(tensor.shape), "at": offset})
        offset += -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN
    header = {"key": key, "tensors": entries, "tree": tree}
    start = _data_start(len(json.dumps(header | {"size": 0, "start": 0}).encode()) + 64)
    raw = json.dumps(header | {"size": start + offset, "start": start}).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".packing-", delete=False) as file:
        try:
            file.write(MAGIC + struct.pack("<Q", len(raw)) + raw)
            for tensor, entry in zip(tensors, entries, strict=True):
                file.seek(start + entry["at"])
                file.write(tensor.detach().contiguous().view(torch.uint8).reshape(-1).numpy())
            file.truncate(start + offset)
            file.flush()
            os.fsync(file.fileno())
        except BaseException:
            Path(file.name).unlink(missing_ok=True)
            raise
    os.replace(file.name, path)
    return start + offset


def load(path: Path, key: str) -> tuple[ModelWeights | None, str]:
    """The weights mapped from `path`, or None and why they cannot be used."""
    try:
        size = path.stat().st_size
        with path.open("rb") as file:
            if file.read(len(MAGIC)) != MAGIC:
                return None, "not a packed-weight file"
            (length,) = struct.unpack("<Q", file.read(8))
            if length > MAX_HEADER:
                return None, f"unreadable (a header of {length} bytes)"
            header = json.loads(file.read(length))
        if header["key"] != key:
            return None, "made for other weights or another kernel layout"
        if size != header["size"]:
            return None, f"truncated or overlong: {size} bytes, its header says {header['size']}"
        data = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)
        tensors = [_tensor(data, header["start"], entry) for entry in header["tensors"]]
        weights = _build(header["tree"], tensors, {})
    except FileNotFoundError:
        return None, "none yet"
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, struct.error) as exc:
        return None, f"unreadable ({exc!r})"
    if not isinstance(weights, ModelWeights):
        return None, "unreadable (no model weights in it)"
    return weights, "mapped"


def _tensor(data: torch.Tensor, start: int, entry: dict[str, Any]) -> torch.Tensor:
    """One tensor of the mapped file: a view, no copy."""
    dtype, shape = DTYPES[entry["dtype"]], [int(n) for n in entry["shape"]]
    at = start + int(entry["at"])
    if at % ALIGN:
        raise ValueError(f"a tensor at {at}, off the {ALIGN}-byte alignment")
    count = 1
    for extent in shape:
        count *= extent
    return data[at : at + count * dtype.itemsize].view(dtype).view(shape)


def _data_start(header_bytes: int) -> int:
    return -(-(len(MAGIC) + 8 + header_bytes) // ALIGN) * ALIGN


def _tree(value: object, tensors: list[torch.Tensor], seen_t: dict, seen_o: dict) -> Any:
    """`value` as JSON: tensors by their index in `tensors` (each once), dataclasses of
    TREE_TYPES by name and fields (the same object twice: a reference to the first)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, torch.Tensor):
        if id(value) not in seen_t:
            seen_t[id(value)] = len(tensors)
            tensors.append(value)
        return {"tensor": seen_t[id(value)]}
    if isinstance(value, list):
        return {"list": [_tree(v, tensors, seen_t, seen_o) for v in value]}
    name = type(value).__name__
    if TREE_TYPES.get(name) is not type(value):
        raise NotCacheable(f"{name} is not cached")
    if id(value) in seen_o:
        return {"same": seen_o[id(value)]}
    seen_o[id(value)] = len(seen_o)
    fields = {
        f.name: _tree(getattr(value, f.name), tensors, seen_t, seen_o)
        for f in dataclasses.fields(value)  # type: ignore[arg-type]
    }
    return {"type": name, "id": seen_o[id(value)], "fields": fields}


def _build(node: Any, tensors: list[torch.Tensor], made: dict[int, object]) -> Any:
    if not isinstance(node, dict):
        return node
    if "tensor" in node:
        return tensors[node["tensor"]]
    if "list" in node:
        return [_build(n, tensors, made) for n in node["list"]]
    if "same" in node:
        return made[node["same"]]
    fields = {name: _build(n, tensors, made) for name, n in node["fields"].items()}
    made[node["id"]] = value = TREE_TYPES[node["type"]](**fields)
    return value

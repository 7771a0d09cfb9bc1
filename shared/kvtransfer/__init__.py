"""KV block transfer between workers (DESIGN.md section 4).

Wire layout of one `shared.protocol.KVChunk` (the `nats` transport):

| field | meaning |
|---|---|
| `request_id` | the request whose prompt KV this is |
| `chunk_index` | 0, 1, 2, … in sending order; `KVDone.num_chunks` counts them |
| `layer_start`, `layer_end` | the layer range carried, `[start, end)` within the model |
| `first_block` | index in the request's block table of the first block carried |
| `block_hashes` | chained prefix hash of each block carried; `None` for a partly filled one |
| `dtype` | `"float32"`, `"bfloat16"` or `"float16"`: the engine's KV dtype on both sides |
| `shape` | `[layers, blocks, block_size, 2, kv_heads, head_dim]` (K at 2-index 0, V at 1) |
| `data` | the tensor's raw bytes, C order, native (little-endian) byte order |

A transfer sends the blocks the decode worker does not already hold (`first_block` ≥ the
reservation's `num_cached_blocks`), cut into layer groups, and a group into block runs when
one layer alone exceeds the byte limit, so every frame fits under the server's max_payload.
Each chunk is a request/reply acknowledged with a `TaskAck`; a few are in flight at once.
`KVDone` closes the transfer (any outcome but OK drops the reservation). The receiver
checks every field against its own cache layout and the reservation (`from_chunk`) before
writing.
"""

from shared.kvtransfer.chunks import BadChunk, KVLayout, from_chunk, to_chunks

__all__ = ["BadChunk", "KVLayout", "from_chunk", "to_chunks"]

"""What the second tier costs when nothing is reused (issue 59: the miss path costs nothing
measurable): however many steps a prompt waits, its blocks are hashed once; the blocks one
call evicts are copied out of the pool in one gather, and stored bit for bit."""

from __future__ import annotations

import torch

import shared.engine.block_hash as block_hash_module
from shared.engine.block_hash import hash_full_blocks
from shared.engine.block_manager import BlockManager
from shared.engine.kv_cache import KVCache
from shared.engine.kv_tier.entry import decode_entry
from shared.engine.kv_tier.tier import KVTier
from shared.engine.model_config import ModelConfig
from shared.engine.sampler import SampledToken
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler import BatchScheduler
from shared.engine.sequence import Sequence
from shared.engine.stopping import StopRules

BS = 4
MODEL_ID = "tiny"
CONFIG = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=100,
    hidden_size=8,
    intermediate_size=16,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=2,
    rope_theta=1e4,
    rms_norm_eps=1e-6,
    max_position_embeddings=256,
    tie_word_embeddings=True,
    attention_bias=False,
)


class MissTier:
    """A tier that holds nothing (no prompt is ever reused); it records what it is given."""

    def __init__(self) -> None:
        self.saves: list[list[tuple[int, int]]] = []

    def save(self, evicted: list[tuple[int, int]]) -> None:
        self.saves.append(list(evicted))

    def asked(self, hashes: list[int]) -> None:
        pass

    def held_run(self, hashes: list[int]) -> int:
        return 0

    def pays(self) -> bool:
        return True

    def loading(self, hashes: list[int]) -> bool:
        return False

    def skip(self, num_blocks: int) -> None:
        assert num_blocks == 0

    def load(self, block_ids: list[int], hashes: list[int]) -> int:
        raise AssertionError("nothing is held, nothing is loaded")


def test_a_waiting_prompt_is_hashed_once_however_many_steps_it_waits(monkeypatch):
    calls = 0
    real_hash = block_hash_module.hash_block

    def counting(parent: int, token_ids: list[int], model_id: str) -> int:
        nonlocal calls
        calls += 1
        return real_hash(parent, token_ids, model_id)

    monkeypatch.setattr(block_hash_module, "hash_block", counting)
    tier = MissTier()
    blocks = BlockManager(16, BS, MODEL_ID, tier=tier)  # type: ignore[arg-type]
    # one sequence at a time, 8 tokens a step: each prompt waits for many steps
    scheduler = BatchScheduler(blocks, 8, 1, StopRules((), 1000))
    seqs = []
    for index in range(6):  # 6 distinct prompts of 5 full blocks and 2 tokens: no reuse
        prompt = [index * 100 + t for t in range(5 * BS + 2)]
        seqs.append(Sequence(f"r{index}", prompt, len(prompt), SamplingParams(max_tokens=6), 0))
        scheduler.add(seqs[-1])
    steps = 0
    while scheduler.has_work():
        out = scheduler.schedule()
        sampled = [[SampledToken(7, None)] for chunk in out.chunks if chunk.completes]
        scheduler.update(out, sampled)
        steps += 1
    assert steps > 6 * 3  # the later prompts waited through many steps
    hashed = sum(len(seq.token_block_hashes) for seq in seqs)
    assert calls == hashed  # every block hash computed is kept: none computed twice
    for seq in seqs:  # the right ones, every block the engine computed included
        kept = seq.token_block_hashes
        assert len(kept) >= (seq.num_tokens - 1) // BS
        assert kept == hash_full_blocks(seq.token_ids, BS, MODEL_ID)[: len(kept)]
    evicted = [pair for batch in tier.saves for pair in batch]
    assert evicted and len({h for _, h in evicted}) == len(evicted)


def test_the_blocks_one_call_evicts_are_copied_in_one_gather_and_stored_bit_for_bit(
    tmp_path, monkeypatch
):
    kv_cache = KVCache(CONFIG, num_blocks=8, block_size=BS, dtype=torch.bfloat16)
    for layer in kv_cache.layers:  # every block of every layer distinct
        layer.copy_(torch.randn(layer.shape).to(torch.bfloat16))
    tier = KVTier.open(kv_cache, MODEL_ID, tmp_path, capacity_bytes=1 << 20)
    gathers: list[list[int]] = []
    read_blocks = kv_cache.read_blocks

    def spy(block_ids: list[int], layers: range) -> torch.Tensor:
        gathers.append(list(block_ids))
        return read_blocks(block_ids, layers)

    monkeypatch.setattr(kv_cache, "read_blocks", spy)
    blocks = BlockManager(8, BS, MODEL_ID, tier=tier)
    first = computed(blocks, "a", list(range(8 * BS)))  # 8 cached blocks: the whole pool
    blocks.free(first)
    second = computed(blocks, "b", list(range(50, 50 + 6 * BS)))  # evicts 6 of first's
    assert gathers == [] and tier.stats().unwritten == 6  # no block has returned yet
    before = {h: kv_cache.read_blocks([b], range(3)).clone() for h, b in blocks.cached.items()}
    gathers.clear()
    blocks.free(second)
    third = Sequence("c", list(range(8 * BS)), 8 * BS, SamplingParams(), 0)
    blocks.allocate(third)  # first's evicted blocks return: from now on evictions are written
    blocks.allocate_slots(third, third.num_uncomputed_tokens)  # evicts second's 6 at once
    assert len(gathers) == 1 and len(gathers[0]) == 6
    assert tier.writer.flush()
    saved = [h for h in before if tier.store.holds(h)]
    assert len(saved) == 6 and tier.stats().dropped_writes == 0
    for block_hash in saved:
        payload = decode_entry(tier.layout, block_hash, tier.store.get(block_hash) or b"")
        block = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        stored = block.view(torch.bfloat16).view(tier.layout.shape)
        assert torch.equal(stored, before[block_hash][:, 0])
    tier.close()


def computed(blocks: BlockManager, request_id: str, prompt: list[int]) -> Sequence:
    """`prompt` admitted, its every token computed and its full blocks cached."""
    seq = Sequence(request_id, prompt, len(prompt), SamplingParams(), 0)
    blocks.allocate(seq)
    blocks.allocate_slots(seq, seq.num_uncomputed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    blocks.commit(seq)
    return seq


def test_blocks_beyond_the_writers_room_are_not_copied_and_are_counted(tmp_path, monkeypatch):
    kv_cache = KVCache(CONFIG, num_blocks=8, block_size=BS, dtype=torch.float32)
    tier = KVTier.open(kv_cache, MODEL_ID, tmp_path, capacity_bytes=1 << 20)
    monkeypatch.setattr(tier.writer, "room", lambda: 2)
    gathers: list[list[int]] = []
    read_blocks = kv_cache.read_blocks
    monkeypatch.setattr(
        kv_cache, "read_blocks", lambda ids, layers: gathers.append(ids) or read_blocks(ids, layers)
    )
    tier.save([(0, 11), (1, 12), (2, 13)])  # not written: no block has returned yet
    tier.asked([11, 12, 13])  # now they have
    tier.save([(0, 11), (1, 12), (2, 13)])
    assert gathers == [[0, 1]] and tier.stats().dropped_writes == 1
    assert tier.writer.flush() and tier.held_run([11, 12, 13]) == 2
    tier.close()

"""Prefix blocks read from another worker (services/worker/peer_reads.py) between real
workers over the `fake` transport: the test plays scheduler, hinting the prefill worker that
the decode worker holds the prompt's prefix. A read gives the tokens one engine computing
everything gives; a holder that dies mid-read, a late READ, a holder that is gone, and a
stale or forged pin answer all fall back to computing, with the stream unaffected and the
reason counted; no block is left pinned or taken on either side. A hint naming several
holders reads from the next when the first is gone."""

from __future__ import annotations

import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from shared.kvtransfer.fake_transport import FakeFabric, ReadFault
from shared.prefix_messages import PeerFallback, PeerHolder, PeerPrefix, PrefixPin, PrefixPinned
from shared.protocol import DecodeTask, Outcome, PrefillTask, Reservation, Reserve, TaskAck
from tests.integration.test_worker import GREEDY, Mesh, reference, run_mesh, until
from tests.integration.test_worker_one_sided import all_blocks_free, fake_factory

LONG = [(5 * i) % 250 + 3 for i in range(82)]  # 5 full blocks before its last token
OTHER = [(3 * i) % 250 + 7 for i in range(82)]
FULL = 5


async def warm(mesh: Mesh, request_id: str, prompt: list[int]) -> None:
    """The decode worker computes `prompt` alone: its pool then holds the prefix."""
    task = DecodeTask(mesh.request(request_id, GREEDY, prompt))
    ack = await mesh.bus.request(mesh.subjects.decode("decode"), task, TaskAck, 5)
    assert ack.ok, ack.error
    await mesh.tokens(request_id)


async def hinted(mesh: Mesh, request_id: str, prompt: list[int], hint: PeerPrefix) -> list[int]:
    """The split path, with the prefill worker told where the prefix is; the tokens."""
    request = mesh.request(request_id, GREEDY, prompt)
    res = await mesh.bus.request(mesh.subjects.reserve("decode"), Reserve(request), Reservation, 5)
    assert res.ok, res.error
    task = PrefillTask(request, "decode", res.num_cached_blocks, res.transports, res.epoch, hint)
    ack = await mesh.bus.request(mesh.subjects.prefill("prefill"), task, TaskAck, 10)
    assert ack.ok, ack.error
    return await mesh.tokens(request_id)


def holder_hint(mesh: Mesh, holder: str = "decode", epoch: int | None = None) -> PeerPrefix:
    worker = next((w for w in mesh.workers if w.config.worker_id == holder), None)
    known = worker.epoch if worker is not None else 0
    return PeerPrefix(holder, known if epoch is None else epoch, 0, FULL)


async def fallbacks(mesh: Mesh, reason: PeerFallback, count: int) -> None:
    mesh.beats.clear()
    await until(lambda: "prefill" in mesh.beats)
    await until(lambda: mesh.beats["prefill"].kv_peer_reads.fallbacks[reason] == count)


def test_a_prefix_read_from_a_peer_streams_what_one_engine_computes(nats_server, tiny_model_dir):
    fabric = FakeFabric()

    async def scenario(mesh: Mesh) -> None:
        await warm(mesh, "warm", LONG)
        tokens = await hinted(mesh, "read", LONG, holder_hint(mesh))
        assert tokens == reference(tiny_model_dir, LONG, GREEDY)
        assert mesh.chunks["read"][0].num_cached_tokens == FULL * 16  # computed only the rest
        mesh.beats.clear()
        await until(lambda: "prefill" in mesh.beats and "decode" in mesh.beats)
        reads = mesh.beats["prefill"].kv_peer_reads
        assert (reads.blocks, sum(reads.fallbacks)) == (FULL, 0)
        assert reads.bytes > 0 and reads.seconds > 0
        assert mesh.beats["decode"].kv_peer_reads.pinned_for_peers == FULL
        await until(lambda: all_blocks_free(mesh), timeout=5)  # the pin was let go
        url = f"http://127.0.0.1:{mesh.beats['prefill'].metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as reply:
            families = text_string_to_metric_families(reply.read().decode())
        samples = {
            (s.name, s.labels.get("reason", "")): s.value for f in families for s in f.samples
        }
        assert samples["splitserve_kv_peer_read_blocks_total", ""] == FULL
        assert samples["splitserve_kv_peer_read_fallbacks_total", "read_failed"] == 0

    run_mesh(
        nats_server.url,
        tiny_model_dir,
        scenario,
        transport_factory=fake_factory(fabric),
        metrics_port=0,
    )


def test_a_late_read_or_a_holder_dying_mid_read_means_recompute(nats_server, tiny_model_dir):
    fabric = FakeFabric()

    class DiesMidRead(dict):
        """The fabric's faults, looked up as each READ polls: the holder dies at the first."""

        def get(self, peer, default=None):
            if peer == "decode":  # READs from the holder; the hand-off READs from "prefill"
                fabric.remove(peer)
            return super().get(peer, default)

    async def scenario(mesh: Mesh) -> None:
        await warm(mesh, "warm-long", LONG)
        await warm(mesh, "warm-other", OTHER)
        fabric.set_fault("decode", ReadFault.STALL)  # READs from the holder never end
        started = time.monotonic()
        assert await hinted(mesh, "late", LONG, holder_hint(mesh)) == reference(
            tiny_model_dir, LONG, GREEDY
        )
        assert time.monotonic() - started < 5  # the read gave up at its 0.5 s deadline
        await fallbacks(mesh, PeerFallback.READ_LATE, 1)
        # The late READ, given up on, still holds its blocks until it ends (as NIXL's would):
        # let it land first, so the holder below dies in the next READ, not in that one.
        fabric.set_fault("decode", ReadFault.NONE)
        await until(lambda: all_blocks_free(mesh), timeout=5)
        fabric.faults = DiesMidRead()
        tokens = await hinted(mesh, "orphan", OTHER, holder_hint(mesh))
        assert tokens == reference(tiny_model_dir, OTHER, GREEDY)
        assert all(not c.error for c in mesh.chunks["orphan"])
        assert mesh.chunks["orphan"][0].num_cached_tokens == 0
        await fallbacks(mesh, PeerFallback.READ_FAILED, 1)
        assert mesh.beats["prefill"].kv_peer_reads.blocks == 0
        await until(lambda: all_blocks_free(mesh), timeout=5)

    run_mesh(
        nats_server.url,
        tiny_model_dir,
        scenario,
        transport_factory=fake_factory(fabric),
        kv_peer_read_timeout=0.5,
    )


def prompt(k: int) -> list[int]:
    return [(k + 3 * i) % 250 + 3 for i in range(82)]


def test_a_gone_holder_and_stale_or_forged_pins_are_refused(nats_server, tiny_model_dir):
    fabric = FakeFabric()

    async def scenario(mesh: Mesh) -> None:
        ghost = await hinted(mesh, "ghost", prompt(1), holder_hint(mesh, "ghost"))
        assert ghost == reference(tiny_model_dir, prompt(1), GREEDY)
        await fallbacks(mesh, PeerFallback.HOLDER_GONE, 1)
        layout = fabric.transports["prefill"].layout
        forgeries = {
            "stale": {"epoch": 99},  # another process of the holder than the hint named
            "forged": {"hashes": 1},  # hashes not the ones asked for
        }

        async def forger(pin: PrefixPin, headers) -> PrefixPinned:
            change = forgeries[pin.pin_id]
            hashes = [h ^ change.get("hashes", 0) for h in pin.block_hashes]
            return PrefixPinned(
                pin.pin_id, Outcome.OK, "", "forger", change.get("epoch", 3), "fake",
                b"prefill", 64, [layout.num_layers, *layout.block_shape], layout.dtype,
                [1, 2, 3, 4, 5][: len(hashes)], hashes, time.time() + 10,
            )  # fmt: skip

        def bad(reason: str) -> PrefixPinned:
            return PrefixPinned("?", Outcome.INVALID, reason)

        await mesh.bus.serve(mesh.subjects.prefix("forger"), PrefixPin, forger, bad)
        for count, name in enumerate(forgeries, start=1):
            tokens = await hinted(mesh, name, prompt(count + 1), PeerPrefix("forger", 3, 0, FULL))
            assert tokens == reference(tiny_model_dir, prompt(count + 1), GREEDY)
            await fallbacks(mesh, PeerFallback.BAD_REPLY, count)
        # a pin for another process of a real holder: the holder itself refuses it
        await hinted(mesh, "old-epoch", prompt(9), holder_hint(mesh, epoch=12345))
        await fallbacks(mesh, PeerFallback.PIN_REFUSED, 1)
        assert mesh.beats["prefill"].kv_peer_reads.blocks == 0
        await until(lambda: all_blocks_free(mesh), timeout=5)

    run_mesh(nats_server.url, tiny_model_dir, scenario, transport_factory=fake_factory(fabric))


def test_a_read_from_a_gone_holder_goes_on_to_the_next_holder_named(nats_server, tiny_model_dir):
    fabric = FakeFabric()

    async def scenario(mesh: Mesh) -> None:
        await warm(mesh, "warm", LONG)
        epoch = holder_hint(mesh).holder_epoch
        hint = PeerPrefix("ghost", 0, 0, FULL, [PeerHolder("decode", epoch, FULL)])
        assert await hinted(mesh, "next", LONG, hint) == reference(tiny_model_dir, LONG, GREEDY)
        assert mesh.chunks["next"][0].num_cached_tokens == FULL * 16  # read from "decode"
        await fallbacks(mesh, PeerFallback.HOLDER_GONE, 1)  # "ghost", counted
        assert mesh.beats["prefill"].kv_peer_reads.blocks == FULL
        await until(lambda: all_blocks_free(mesh), timeout=5)

    run_mesh(nats_server.url, tiny_model_dir, scenario, transport_factory=fake_factory(fabric))

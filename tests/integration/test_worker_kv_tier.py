"""A decode worker with a second KV tier, over a real nats-server: a prompt whose blocks
were evicted from its pool is reserved with them loaded from the tier, so the prefill worker
does not send them again, the stream is what one engine gives, and the tier's counters reach
the heartbeat and /metrics."""

from __future__ import annotations

import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from shared.engine.sampling_params import SamplingParams
from tests.integration.test_worker import PROMPT, Mesh, reference, run_mesh, until

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
FILLERS = [[(13 * i + k) % 250 + 3 for i in range(150)] for k in (1, 2)]  # 10 blocks each


def test_blocks_evicted_to_the_tier_are_not_sent_again(nats_server, tiny_model_dir, tmp_path):
    async def scenario(mesh: Mesh) -> None:
        for round in range(2):  # written once evicted blocks return: PROMPT's second time
            first = await mesh.split(mesh.request(f"first{round}", GREEDY))
            assert first.num_cached_blocks == 0
            await mesh.tokens(f"first{round}")
            for index, filler in enumerate(FILLERS):  # evict PROMPT's 3 full blocks
                await mesh.split(mesh.request(f"filler{round}.{index}", GREEDY, filler))
                await mesh.tokens(f"filler{round}.{index}")

        seen = {"bytes": -1.0, "since": 0.0}

        def written() -> bool:  # the second round's evictions are all written, PROMPT's too
            beat = mesh.beats.get("decode")
            if beat is None:
                return False
            stored, now = beat.kv_tier.stored_bytes, time.monotonic()
            if stored != seen["bytes"]:
                seen.update(bytes=stored, since=now)  # still writing
            return stored >= 3 * beat.block_bytes and now - seen["since"] >= 0.3

        await until(written)
        again = await mesh.split(mesh.request("again", GREEDY))
        assert again.num_cached_blocks == 3  # from the tier: the pool had lost them
        assert await mesh.tokens("again") == reference(tiny_model_dir, PROMPT, GREEDY)
        assert mesh.blocks_sent["again"] == 1  # only the partly filled last block
        await until(lambda: mesh.beats["decode"].kv_tier.hits >= 3)
        beat = mesh.beats["decode"]
        assert beat.kv_tier.capacity_bytes == 1 << 24 and beat.kv_tier.refused == 0

        def exported() -> dict[str, float]:
            url = f"http://127.0.0.1:{beat.metrics_port}/metrics"
            with urllib.request.urlopen(url, timeout=5) as reply:
                families = text_string_to_metric_families(reply.read().decode())
            return {s.name: s.value for f in families for s in f.samples if "kv_tier" in s.name}

        await until(lambda: exported().get("splitserve_kv_tier_hits_total", 0) >= 3, timeout=5)

    tier = {"num_kv_blocks": 12, "kv_offloading_size": 1 / 64, "kv_offloading_dir": str(tmp_path)}
    run_mesh(nats_server.url, tiny_model_dir, scenario, engine=tier, metrics_port=0)

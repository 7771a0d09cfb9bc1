"""The typed bus over a real nats-server: request/reply, pub/sub, bad frames survive."""

from __future__ import annotations

import asyncio

from shared.bus import Bus
from shared.protocol import Cancel, Outcome, TaskAck, decode
from shared.subjects import Subjects


def test_request_reply_publish_and_bad_frames(nats_server):
    async def scenario() -> None:
        subjects = Subjects("t1")
        server = await Bus.connect(nats_server.url, "server")
        client = await Bus.connect(nats_server.url, "client")
        got: list[Cancel] = []
        arrived = asyncio.Event()

        async def on_cancel(message: Cancel, headers: dict[str, str]) -> None:
            got.append(message)
            assert headers.get("traceparent") == "00-abc-def-01"
            arrived.set()

        async def answer(message: Cancel, headers: dict[str, str]) -> TaskAck:
            return TaskAck(request_id=message.request_id, outcome=Outcome.OK)

        await server.subscribe(subjects.cancel, Cancel, on_cancel)
        await server.serve(
            subjects.prefill("w1"), Cancel, answer, lambda why: TaskAck("", Outcome.INVALID, why)
        )
        await server.nc.flush()
        await client.nc.publish(subjects.cancel, b"\x93garbage")  # dropped, logged
        await client.publish(
            subjects.cancel, Cancel("r1"), headers={"traceparent": "00-abc-def-01"}
        )
        await asyncio.wait_for(arrived.wait(), 5)
        assert [m.request_id for m in got] == ["r1"]

        ack = await client.request(subjects.prefill("w1"), Cancel("r2"), TaskAck, timeout=5)
        assert ack == TaskAck("r2", Outcome.OK) and ack.ok
        bad = await client.nc.request(subjects.prefill("w1"), b"nonsense", timeout=5)
        refused = decode(bad.data, TaskAck)
        assert refused.outcome == Outcome.INVALID and "msgpack" in refused.error
        await client.close()
        await server.close()

    asyncio.run(scenario())

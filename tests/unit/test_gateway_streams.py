"""A request's token stream at the gateway: repeats dropped or trimmed, and a gap (chunks
lost with a NATS node that died) ends the attempt with an error, so the request migrates
from its last delivered token instead of streaming a text with a hole."""

from __future__ import annotations

from services.gateway.streams import RequestStream
from shared.protocol import TokenChunk


def drain(stream: RequestStream) -> list[TokenChunk]:
    chunks = []
    while not stream.queue.empty():
        chunks.append(stream.queue.get_nowait())
    return chunks


def test_repeated_tokens_are_dropped_or_trimmed():
    stream = RequestStream("r")
    stream.offer(TokenChunk("r", 0, [5, 6]))
    stream.offer(TokenChunk("r", 0, [5, 6]))  # the same chunk again
    stream.offer(TokenChunk("r", 1, [6, 7]))  # half of it new
    assert [(c.index, c.token_ids) for c in drain(stream)] == [(0, [5, 6]), (2, [7])]
    assert stream.next_index == 3


def test_a_gap_fails_the_attempt_and_nothing_after_it_is_delivered():
    stream = RequestStream("r")
    stream.offer(TokenChunk("r", 0, [5, 6]))
    stream.offer(TokenChunk("r", 3, [8]))  # token 2 never came
    stream.offer(TokenChunk("r", 4, [9]))
    stream.offer(TokenChunk("r", 2, [7]))  # too late: the attempt is over
    delivered, failure = drain(stream)
    assert delivered.token_ids == [5, 6]
    assert failure.index == 2 and not failure.token_ids
    assert failure.error == "tokens 2..2 were lost on the way"
    assert stream.next_index == 2


def test_a_migrated_attempt_goes_on_from_the_tokens_delivered_before_it():
    stream = RequestStream("r~1", next_index=3)  # 3 tokens delivered by attempt 0
    stream.offer(TokenChunk("r~1", 3, [8, 9]))
    assert [(c.index, c.token_ids, c.error) for c in drain(stream)] == [(3, [8, 9], "")]

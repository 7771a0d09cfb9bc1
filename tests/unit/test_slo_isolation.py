"""`splitserve bench isolation`'s arithmetic on hand-made records: gaps go to the window of
their later chunk, the figures of a round, and the rounds it refuses (streams not running
through both windows, failures); its flags refused by name."""

from __future__ import annotations

import pytest

from loadtest.request import RequestRecord
from loadtest.slo.isolation import RoundRefused, gaps_in, judge
from services.cli import build_parser
from shared.errors import ConfigError


def stream(first: float, gap: float, count: int, stall_at: float = -1.0, stall: float = 0.0):
    """Chunks every `gap` from `first`; the chunk due after `stall_at` comes `stall` late,
    and the rest follow it."""
    times, t = [], first
    for _ in range(count):
        if stall and stall_at <= t < stall_at + gap:
            t += stall
        times.append(t)
        t += gap
    return RequestRecord("stream", 0.0, times, output_tokens=count, end=times[-1])


def burst(sent: float, first_token: float) -> RequestRecord:
    return RequestRecord("burst", sent, [first_token], output_tokens=1, end=first_token)


def test_a_gap_belongs_to_the_window_of_its_later_chunk():
    r = RequestRecord("s", 0.0, [0.0, 1.0, 2.5, 3.0])
    assert gaps_in([r], 1.0, 3.0) == [1.0, 1.5]
    assert gaps_in([r], 2.6, 10.0) == [0.5]
    assert gaps_in([r], 5.0, 6.0) == []


def test_a_round_compares_the_streams_gaps_before_and_during_the_burst():
    streams = [stream(0.05, 0.1, 120, stall_at=6.0, stall=0.3) for _ in range(2)]
    result = judge(streams, [burst(5.0, 7.0), burst(5.0, 7.5)], sent=5.0, quiet_s=3.0)
    assert result.quiet_p50_ms == pytest.approx(100.0)
    assert result.quiet_p99_ms == pytest.approx(100.0)
    assert result.burst_p99_ms == pytest.approx(400.0)  # the stall, in the burst's window
    assert result.burst_p50_ms == pytest.approx(100.0)
    assert result.burst_s == pytest.approx(2.5)
    assert result.ratio == pytest.approx(4.0)
    calm = judge([stream(0.05, 0.1, 120)], [burst(5.0, 7.0)], sent=5.0, quiet_s=3.0)
    assert calm.ratio == pytest.approx(1.0)


def test_a_round_whose_windows_do_not_hold_running_streams_is_refused():
    with pytest.raises(RoundRefused, match="--settle"):
        judge([stream(2.5, 0.02, 600)], [burst(5.0, 7.0)], sent=5.0, quiet_s=3.0)
    with pytest.raises(RoundRefused, match="--stream-len"):
        judge([stream(0.1, 0.02, 300)], [burst(5.0, 7.0)], sent=5.0, quiet_s=3.0)
    failed = RequestRecord("burst", 5.0, [], error="http_503", error_detail="overloaded")
    with pytest.raises(RoundRefused, match="http_503"):
        judge([stream(0.1, 0.02, 600)], [failed], sent=5.0, quiet_s=3.0)


def test_bad_flags_are_refused_by_name():
    from loadtest.slo.isolation_cli import config_from_args

    parser = build_parser()
    args = parser.parse_args(["bench", "isolation", "--burst", "0", "--rounds", "-1"])
    with pytest.raises(ConfigError, match="--burst, --rounds"):
        config_from_args(args)
    args = parser.parse_args(["bench", "isolation", "--configs", "split=prefill:0,decode:0"])
    with pytest.raises(ConfigError):
        config_from_args(args)

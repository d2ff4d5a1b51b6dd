"""The rate limit of repeated warnings: a flood of one event writes about log2(n) lines, each with its
count; identities that a sender chose are printed as short printable ASCII."""

from __future__ import annotations

from mas_async.runtime import log_limit
from mas_async.runtime.log_limit import LogLimit, printable


def test_logs_the_powers_of_two_of_each_key_with_its_count():
    limit = LogLimit()
    logged = [n for n in (limit.due("malformed") for _ in range(3000)) if n]
    assert logged == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048]
    assert limit.due("other") == 1  # each key counts on its own
    assert limit.counts == {"malformed": 3000, "other": 1}


def test_a_trickle_that_goes_on_is_logged_again_after_the_interval(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(log_limit.time, "monotonic", lambda: now[0])
    limit = LogLimit(interval_s=60)
    assert [limit.due("k") for _ in range(4)] == [1, 2, 0, 4]
    assert limit.due("k") == 0  # 5th, a second later: nothing
    now[0] += 61
    assert limit.due("k") == 6  # the first one past the interval
    assert limit.due("k") == 0


def test_identities_are_printed_as_short_printable_ascii():
    assert printable(b"env_worker/0") == "env_worker/0"
    assert printable(b"\x00k\x8bEg") == "\\x00k\\x8bEg"  # a ZeroMQ-made identity: NUL, invalid UTF-8
    assert printable("caf\u00e9\n\u2028") == "caf\\xe9\\n\\u2028"
    long = printable(bytes(range(256)) * 4)
    assert len(long) == 64 + 3 and long.endswith("...")
    assert all(c.isascii() and c.isprintable() for c in long)

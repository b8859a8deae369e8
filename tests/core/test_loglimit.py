"""``CauseLimiter``: one log line per cause per interval, a new cause at once, the held-back count told."""

from __future__ import annotations

import threading
import time

import pytest

from kvtier.core.tiers.loglimit import CauseLimiter, held_back


def test_a_new_cause_is_admitted_at_once_and_a_repeated_one_once_per_interval():
    limiter = CauseLimiter(interval_s=0.3)
    assert limiter.admit("No space left on device") == 0
    assert [limiter.admit("No space left on device") for _ in range(5)] == [None] * 5
    assert limiter.admit("Read-only file system") == 0  # a new cause, within the first one's interval
    assert limiter.admit("Read-only file system") is None
    time.sleep(0.35)
    assert limiter.admit("No space left on device") == 5  # the five held back since its last line
    assert limiter.admit("No space left on device") is None
    assert limiter.admit("Read-only file system") == 1


def test_forget_admits_every_cause_again_and_zero_interval_admits_all():
    limiter = CauseLimiter(interval_s=60)
    assert limiter.admit("connection refused") == 0 and limiter.admit("connection refused") is None
    limiter.forget()
    assert limiter.admit("connection refused") == 0
    every = CauseLimiter(interval_s=0)
    assert [every.admit("timed out") for _ in range(3)] == [0, 0, 0]


def test_past_max_causes_the_one_logged_longest_ago_is_forgotten():
    limiter = CauseLimiter(interval_s=60, max_causes=2)
    assert limiter.admit("a") == 0 and limiter.admit("b") == 0
    assert limiter.admit("b") is None
    assert limiter.admit("c") == 0  # "a" forgotten: the oldest line
    assert limiter.admit("b") is None and limiter.admit("c") is None
    assert limiter.admit("a") == 0  # admitted again; "b" forgotten now
    assert limiter.admit("b") == 0


def test_concurrent_callers_get_exactly_one_line_per_cause():
    limiter = CauseLimiter(interval_s=60)
    admitted: list[int | None] = []
    lock = threading.Lock()

    def hammer() -> None:
        for _ in range(500):
            got = limiter.admit("HTTP 503 SlowDown")
            with lock:
                admitted.append(got)
    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert admitted.count(0) == 1 and admitted.count(None) == 1999


def test_held_back_suffix_and_bad_arguments():
    assert held_back(0) == "" and held_back(3) == "; 3 more like it since the last such line"
    with pytest.raises(ValueError):
        CauseLimiter(interval_s=-1)
    with pytest.raises(ValueError):
        CauseLimiter(max_causes=0)

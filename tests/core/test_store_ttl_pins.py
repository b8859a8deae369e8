"""Requests' TTL pins in the cpu tier (issue 22 item 4): a pinned prefix survives a flood that
evicts everything else, pins past ``pin_max_share`` are refused and counted, a pin expires by
itself, a renewal keeps the later deadline, and a reset drops pins with the chunks."""

from __future__ import annotations

import time
from pathlib import Path

from kvtier.core.store import TieredStore

from .helpers import chain_of, make_store, payload


def _put(store: TieredStore, prompt: int, num_chunks: int) -> list:
    chain = chain_of(prompt, num_chunks)
    store.put(chain, [payload(k) for k in chain])
    return chain


def _flood(store: TieredStore, first_prompt: int, num_prompts: int) -> None:
    for prompt in range(first_prompt, first_prompt + num_prompts):
        _put(store, prompt, 2)


def test_a_pinned_prefix_survives_a_flood_that_evicts_everything_else(tmp_path: Path) -> None:
    store = make_store(tmp_path, cpu_chunks=8, pin_max_share=0.5)
    system = _put(store, 1, 3)
    other = _put(store, 2, 3)
    assert store.ttl_pin(system, 60.0) == (3, 0)
    _flood(store, 100, 10)  # 20 chunks through an 8-page tier
    assert store.lookup(system) == 3 and store.get(system) == [payload(k) for k in system]
    assert store.lookup(other) == 0
    stats = store.stats()
    assert stats.tier("cpu").ttl_pinned_chunks == 3 and stats.ttl_pin_chunks == 3
    store.check_integrity()


def test_pins_past_the_share_are_refused_and_counted_never_evicting_other_pins(tmp_path: Path) -> None:
    store = make_store(tmp_path, cpu_chunks=8, pin_max_share=0.25)  # 2 of 8 pages
    first = _put(store, 1, 2)
    second = _put(store, 2, 2)
    assert store.ttl_pin(first, 60.0) == (2, 0)
    assert store.ttl_pin(second, 60.0) == (0, 2)
    assert store.ttl_pin(first, 60.0) == (2, 0)  # a renewal needs no more budget
    _flood(store, 100, 8)
    assert store.lookup(first) == 2 and store.lookup(second) == 0
    stats = store.stats()
    assert stats.ttl_pin_refused_chunks == 2 and stats.tier("cpu").ttl_pinned_chunks == 2
    store.check_integrity()


def test_a_pin_expires_by_itself_and_a_renewal_keeps_the_later_deadline(tmp_path: Path) -> None:
    store = make_store(tmp_path, cpu_chunks=8, pin_max_share=0.5)
    short = _put(store, 1, 2)
    renewed = _put(store, 2, 2)
    assert store.ttl_pin(short, 0.2) == (2, 0)
    assert store.ttl_pin(renewed, 0.2) == (2, 0)
    assert store.ttl_pin(renewed, 60.0) == (2, 0)
    assert store.ttl_pin(renewed, 0.1) == (2, 0)  # a shorter pin does not cut the longer one
    deadline = time.monotonic() + 5.0
    while store.stats().tier("cpu").ttl_pinned_chunks != 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store.stats().tier("cpu").ttl_pinned_chunks == 2  # short's pins expired, renewed's did not
    _flood(store, 100, 8)
    assert store.lookup(short) == 0 and store.lookup(renewed) == 2
    store.check_integrity()


def test_only_resident_chunks_are_pinned_and_a_zero_share_turns_pins_off(tmp_path: Path) -> None:
    store = make_store(tmp_path, cpu_chunks=8, pin_max_share=0.5)
    absent = chain_of(9, 2)
    assert store.ttl_pin(absent, 60.0) == (0, 0)
    off = make_store(tmp_path / "off", cpu_chunks=8, pin_max_share=0.0)
    chain = _put(off, 1, 2)
    assert off.ttl_pin(chain, 60.0) == (0, 2)
    assert off.ttl_pin(chain, 0.0) == (0, 0)


def test_a_reset_drops_pins_with_their_chunks(tmp_path: Path) -> None:
    store = make_store(tmp_path, cpu_chunks=8, pin_max_share=0.5)
    system = _put(store, 1, 3)
    store.ttl_pin(system, 60.0)
    store.clear(["cpu"])
    assert store.lookup(system) == 0 and store.stats().tier("cpu").ttl_pinned_chunks == 0
    again = _put(store, 1, 3)
    _flood(store, 100, 8)
    assert store.lookup(again) == 0  # the pin did not outlive the reset
    store.check_integrity()

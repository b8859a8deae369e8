"""The idle-engine settle rule (integrations/vllm/scheduler/steps.py, Settle) narrated step by step, on a fake clock."""

from __future__ import annotations

from kvtier.integrations.vllm.protocol import KVTierWorkerMeta, RankReport
from kvtier.integrations.vllm.scheduler.steps import Settle


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def report(busy: dict[int, bool]) -> KVTierWorkerMeta:
    return KVTierWorkerMeta({rank: RankReport(b"r" * 16, busy=b) for rank, b in busy.items()})


def test_an_engine_steps_until_the_first_report_and_until_every_rank_is_unpinned():
    settle = Settle(settle_s=10.0, clock=Clock())
    assert settle.pending()  # booted: no report yet
    settle.observe(None)  # a step without kvtier's metadata changes nothing
    assert settle.pending()
    settle.observe(report({0: False, 1: True}))
    assert settle.pending()  # rank 1 still pins chunks
    settle.observe(report({1: False}))
    assert not settle.pending()  # rank 0's last word was "not busy": nothing left
    settle.observe(report({0: True}))
    assert settle.pending()


def test_settling_stops_after_the_window_and_starts_again_with_work():
    clock = Clock()
    settle = Settle(settle_s=10.0, clock=clock)
    settle.observe(report({0: True}))
    settle.step(idle=False)
    assert settle.pending()
    settle.step(idle=True)  # the engine ran out of work here
    clock.now += 9.9
    assert settle.pending()
    clock.now += 0.2
    assert not settle.pending()  # a pin that never ends cannot keep the engine spinning
    settle.step(idle=True)
    assert not settle.pending()
    settle.step(idle=False)  # new work: the window starts again from the next idle step
    settle.step(idle=True)
    assert settle.pending()


def test_events_waiting_to_be_published_keep_an_idle_engine_stepping_within_the_same_window():
    clock = Clock()
    waiting = [True]
    settle = Settle(settle_s=10.0, clock=clock, more=lambda: waiting[0])
    settle.observe(report({0: False}))
    settle.step(idle=True)
    assert settle.pending()  # a restart's announcements still wait for the rate limit
    waiting[0] = False
    assert not settle.pending()
    waiting[0] = True
    clock.now += 10.1
    assert not settle.pending()  # bounded like a pin: the rest waits for the next request's steps


def test_a_wake_asks_for_one_step_even_after_the_idle_window_ran_out():
    clock = Clock()
    settle = Settle(settle_s=10.0, clock=clock)
    settle.observe(report({0: False}))
    settle.step(idle=True)
    clock.now += 11
    assert not settle.pending()  # idle past the window: the engine waits for input
    settle.wake()  # a reset between steps
    assert settle.pending()
    settle.step(idle=True)  # the step that carries it
    assert not settle.pending()  # nothing else wanted

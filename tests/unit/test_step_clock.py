"""StepClock: an update's stall and hold, measured from the engine's step times."""

import pytest

from forge.generation.engine_steps import StepClock, UpdateStall


def test_the_stall_runs_from_the_last_step_to_the_first_after_the_load_and_the_hold_from_the_arrival():
    clock = StepClock()
    clock.stepping(0.0, 1.0)
    clock.open(arrived=0.5)  # arrived mid-step; the load starts after it
    clock.stepping(3.0, 3.5)  # the first step after the load
    assert clock.take_stalls() == [UpdateStall(stall_s=2.0, hold_s=2.5)]
    assert clock.steps == 2 and clock.take_busy_s() == pytest.approx(1.5) and clock.take_busy_s() == 0.0


def test_a_drain_holds_from_the_arrival_while_the_stall_starts_at_the_last_tail_step():
    clock = StepClock()
    clock.stepping(9.0, 10.0)  # the tail's last step ended after the update arrived at 4
    clock.open(arrived=4.0)
    clock.stepping(10.25, 11.0)
    assert clock.take_stalls() == [UpdateStall(stall_s=0.25, hold_s=6.25)]


def test_with_no_work_waiting_the_stall_ends_with_the_load_and_is_counted_once():
    clock = StepClock()
    clock.open(arrived=0.0)  # no step ran yet: the stall starts at the arrival
    clock.close_now()
    clock.stepping(1e12, 1e12 + 1)  # a much later step does not reopen it
    (stall,) = clock.take_stalls()
    assert stall.stall_s == stall.hold_s > 0 and stall.stall_s < 1e12
    assert clock.take_stalls() == []

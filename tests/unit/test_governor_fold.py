"""The governor's fold and decisions, as stories: given these events, then this state."""

from __future__ import annotations

import pytest

from grove_events import GlobalLimits, ResourceLimits
from grove_governor.domain import (
    AT_CAPACITY,
    Admit,
    FinishRejection,
    GovernorState,
    InFlight,
    Reject,
    decide,
    evolve,
)
from tests.unit.helpers import Log

pytestmark = pytest.mark.unit

LIMITS = ResourceLimits(**{"global": GlobalLimits(max_concurrent_agents=2)})


def fold(log: Log) -> GovernorState:
    state = GovernorState()
    for recorded in log.records:
        state = evolve(state, recorded)
    return state


def test_a_new_spawn_is_admitted() -> None:
    log = Log()
    log.spawn("a")
    state = fold(log)
    assert decide(state, LIMITS, {}) == [Admit("a", 0)]


def test_at_capacity_the_next_spawn_is_rejected() -> None:
    log = Log()
    for agent in ("a", "b"):
        log.spawn(agent)
        log.status(agent, "admitted")
    log.spawn("c")
    state = fold(log)
    assert state.holding == 2
    assert decide(state, LIMITS, {}) == [Reject("c", 0, AT_CAPACITY)]


def test_in_flight_admissions_count_against_capacity() -> None:
    log = Log()
    for agent in ("a", "b", "c"):
        log.spawn(agent)
    state = fold(log)
    assert decide(state, LIMITS, {}) == [Admit("a", 0), Admit("b", 0), Reject("c", 0, AT_CAPACITY)]
    in_flight = {"a": InFlight(0, admits=True), "b": InFlight(0, admits=True)}
    assert decide(state, LIMITS, in_flight) == [Reject("c", 0, AT_CAPACITY)]


def test_terminate_frees_capacity() -> None:
    log = Log()
    for agent in ("a", "b"):
        log.spawn(agent)
        log.status(agent, "admitted")
    log.status("a", "started")
    log.terminate("a")
    log.spawn("c")
    state = fold(log)
    assert state.holding == 1
    assert "a" not in state.agents
    assert decide(state, LIMITS, {}) == [Admit("c", 0)]


def test_a_rejection_without_its_terminate_is_finished() -> None:
    log = Log()
    log.spawn("a")
    log.status("a", "rejected", AT_CAPACITY)
    state = fold(log)
    assert decide(state, LIMITS, {}) == [FinishRejection("a", AT_CAPACITY)]
    log.terminate("a", "rejected")
    assert decide(fold(log), LIMITS, {}) == []


def test_decisions_are_guarded_by_the_latest_status_sequence() -> None:
    log = Log()
    log.spawn("a")
    log.status("a", "checkpoint")  # an unexpected status moves the guard
    state = fold(log)
    assert decide(state, LIMITS, {}) == [Admit("a", 2)]


def test_a_second_spawn_of_a_live_agent_changes_nothing() -> None:
    log = Log()
    log.spawn("a")
    log.status("a", "admitted")
    log.spawn("a")
    state = fold(log)
    assert state.agents["a"].phase == "admitted"
    assert decide(state, LIMITS, {}) == []


def test_child_inherits_the_parents_tree() -> None:
    log = Log()
    log.spawn("root")
    log.spawn("kid", parent="root")
    assert fold(log).agents["kid"].tree_id == "root"


def test_rows_round_trip_keeps_order_and_counts() -> None:
    log = Log()
    for agent in ("a", "b", "c"):
        log.spawn(agent)
    log.status("b", "admitted")
    state = fold(log)
    rows = {k: v for k, v in state.take_dirty().items() if v is not None}
    again = GovernorState.from_rows(rows)
    assert list(again.agents) == ["a", "b", "c"]
    assert again.holding == 1
    assert list(again.undecided) == ["a", "c"]

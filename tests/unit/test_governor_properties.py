"""Properties of the governor's fold, for any sequence of spawns, terminates and clock ticks:
no limit is ever exceeded, and the state is the same live, replayed, or reloaded from rows."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grove_events import ResourceLimits
from grove_governor.domain import (
    Admit,
    Cancel,
    Finish,
    GovernorState,
    Notice,
    Queue,
    Reject,
    TimeOut,
    decide,
    evolve,
)
from tests.unit.helpers import T0, Log

pytestmark = pytest.mark.unit

LIMITS = ResourceLimits.model_validate(
    {
        "global": {"max_concurrent_agents": 3, "max_spawn_rate": 2},
        "per_parent": {"max_children": 2},
        "per_agent": {"max_runtime": 4},
        "per_tree": {"max_agents": 6, "max_depth": 2},
    }
)

step = st.one_of(
    st.tuples(st.just("spawn"), st.integers(0, 5)),  # parent: an earlier agent, or a root
    st.tuples(st.just("terminate"), st.integers(0, 30)),
    st.tuples(st.just("start"), st.integers(0, 30)),
    st.tuples(st.just("tick"), st.floats(0.1, 3.0)),
    st.tuples(st.just("stop"), st.integers(0, 30)),
)


def apply_decisions(log: Log, state: GovernorState, now: float) -> GovernorState:
    """Run the governor: append what it decides as the events it would append, fold them."""
    at = now - T0.timestamp()
    for decision in decide(state, LIMITS, now, {}, grace_s=1.0):
        slot = state.agents[decision.agent_id]
        details: dict[str, Any] = {}
        if isinstance(decision, Admit):
            details = {"global_rate": 2.0}
            recorded = log.status(decision.agent_id, "admitted", at=at, **details)
        elif isinstance(decision, Queue):
            recorded = log.status(decision.agent_id, "queued", at=at)
        elif isinstance(decision, Reject):
            state = evolve(state, log.status(decision.agent_id, "rejected", decision.error, at=at))
            recorded = log.terminate(decision.agent_id, "rejected")
        elif isinstance(decision, Cancel):
            state = evolve(state, log.status(decision.agent_id, "stopped", decision.why, at=at))
            recorded = log.terminate(decision.agent_id, "cancelled")
        elif isinstance(decision, Finish):
            recorded = log.terminate(decision.agent_id, decision.reason)
        elif isinstance(decision, Notice):
            recorded = log.status(decision.agent_id, "timeout_notice", at=at)
        else:
            assert isinstance(decision, TimeOut)
            recorded = log.terminate(decision.agent_id, "timeout")
        assert slot.agent_id == decision.agent_id
        state = evolve(state, recorded)
    return state


def check_limits(state: GovernorState) -> None:
    running = [s for s in state.agents.values() if s.phase in ("admitted", "running")]
    assert len(running) == state.holding <= 3
    for slot in state.agents.values():
        kids = [s for s in running if s.parent == slot.agent_id]
        assert len(kids) == slot.children_holding <= 2
        assert slot.depth <= 2 or slot.phase in ("ended", "rejected", "pending")
    for tree in state.trees.values():
        assert tree.agents <= 6


@settings(max_examples=150, deadline=None)
@given(st.lists(step, min_size=1, max_size=40))
def test_limits_hold_and_replay_is_the_same(steps: list[tuple[str, Any]]) -> None:
    log = Log()
    state = GovernorState()
    now = T0.timestamp()
    names: list[str] = []
    for kind, arg in steps:
        if kind == "spawn":
            parent = names[arg] if arg < len(names) else None
            name = f"a{len(names)}"
            names.append(name)
            state = evolve(state, log.spawn(name, parent=parent))
        elif kind == "tick":
            now += arg
        elif names:
            target = names[arg % len(names)]
            slot = state.agents[target]
            if kind == "terminate" and slot.phase == "running":
                state = evolve(state, log.terminate(target))
            elif kind == "start" and slot.phase == "admitted":
                state = evolve(state, log.status(target, "started", at=now - T0.timestamp()))
            elif kind == "stop":
                state = evolve(state, log.control(target, "stop"))
        state = apply_decisions(log, state, now)
        check_limits(state)

    replayed = GovernorState()
    for recorded in log.records:
        replayed = evolve(replayed, recorded)
    assert replayed.agents == state.agents
    assert replayed.trees == state.trees
    assert list(replayed.undecided) == list(state.undecided)
    assert replayed.holding == state.holding

    rows = {k: v for k, v in replayed.take_dirty().items() if v is not None}
    reloaded = GovernorState.from_rows(rows)
    assert reloaded.agents == state.agents
    assert list(reloaded.undecided) == list(state.undecided)
    assert decide(reloaded, LIMITS, now, {}) == decide(state, LIMITS, now, {})

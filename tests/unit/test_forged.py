"""Forged spawns: a child that claims another tree, or a parent nobody spawned, is refused
by the governor with a reason naming the lie, and the tree keeps the child where it belongs."""

from __future__ import annotations

import pytest

from grove_core.tree import TreeState
from grove_core.tree import evolve as evolve_tree
from grove_events import ResourceLimits
from grove_governor.domain import Admit, GovernorState, Reject, decide, evolve
from tests.unit.helpers import T0, Log

pytestmark = pytest.mark.unit

NOW = T0.timestamp()
ROOMY = ResourceLimits.model_validate({"global": {"max_concurrent_agents": 10}})


def fold(log: Log) -> GovernorState:
    state = GovernorState()
    for recorded in log.records:
        state = evolve(state, recorded)
    return state


def test_a_child_claiming_another_tree_is_refused_and_counted_in_its_parent_s() -> None:
    log = Log()
    log.spawn("root-a")
    log.spawn("root-b")
    log.status("root-a", "admitted")
    log.status("root-b", "admitted")
    log.spawn("sneaky", parent="root-a", tree_id="root-b")

    state = fold(log)

    assert state.agents["sneaky"].tree_id == "root-a"
    assert decide(state, ROOMY, NOW, {}) == [
        Reject("sneaky", 0, "refused: parent root-a belongs to tree root-a, not to tree root-b")
    ]
    tree = TreeState()
    for recorded in log.records:
        tree = evolve_tree(tree, recorded)
    assert tree.agents["sneaky"].tree_id == "root-a"


def test_a_parent_the_log_does_not_know_is_refused() -> None:
    log = Log()
    log.spawn("orphan", parent="nobody")

    (decision,) = decide(fold(log), ROOMY, NOW, {})

    assert decision == Reject("orphan", 0, "refused: parent nobody is not an agent the log knows")


def test_an_honest_child_naming_its_tree_is_admitted() -> None:
    log = Log()
    log.spawn("root")
    log.status("root", "admitted")
    log.spawn("kid", parent="root", tree_id="root")

    assert decide(fold(log), ROOMY, NOW, {}) == [Admit("kid", 0)]


def test_a_refusal_survives_a_reload_from_rows() -> None:
    log = Log()
    log.spawn("orphan", parent="nobody")
    state = fold(log)
    rows = {k: v for k, v in state.take_dirty().items() if v is not None}

    again = GovernorState.from_rows(rows)

    assert decide(again, ROOMY, NOW, {}) == decide(state, ROOMY, NOW, {})


def test_a_fork_of_an_agent_nobody_spawned_is_refused() -> None:
    log = Log()
    log.fork("copy", source="ghost")

    (decision,) = decide(fold(log), ROOMY, NOW, {})

    assert decision == Reject("copy", 0, "refused: fork source ghost is not an agent the log knows")

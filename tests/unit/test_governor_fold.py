"""The governor's fold and decisions, as stories: given these events, when the governor
decides at time `now`, then these are its decisions."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from grove_core.permissions import effective_permissions, holds, spawn_refusal
from grove_events import AgentConfig, ForkEvent, HitlEvent, ResourceLimits, SpawnEvent, new_id
from grove_governor.domain import (
    AT_CAPACITY,
    MAX_CHILDREN,
    Admit,
    Cancel,
    Finish,
    GovernorState,
    InFlight,
    Notice,
    Queue,
    Reject,
    TimeOut,
    decide,
    effective_agent_limits,
    evolve,
    resource_status,
)
from tests.unit.helpers import T0, Log

pytestmark = pytest.mark.unit

NOW = T0.timestamp()


def limits(**sections: Any) -> ResourceLimits:
    return ResourceLimits.model_validate(sections)


CAP2 = limits(**{"global": {"max_concurrent_agents": 2}})


def fold(log: Log) -> GovernorState:
    state = GovernorState()
    for recorded in log.records:
        state = evolve(state, recorded)
    return state


def admit(log: Log, agent: str, at: float = 0.0, **details: Any) -> None:
    log.status(agent, "admitted", at=at, **details)


def test_a_new_spawn_is_admitted() -> None:
    log = Log()
    log.spawn("a")
    assert decide(fold(log), CAP2, NOW, {}) == [Admit("a", 0)]


def test_at_capacity_the_next_spawn_is_rejected() -> None:
    log = Log()
    for agent in ("a", "b"):
        log.spawn(agent)
        admit(log, agent)
    log.spawn("c")
    state = fold(log)
    assert state.holding == 2
    assert decide(state, CAP2, NOW, {}) == [Reject("c", 0, AT_CAPACITY)]


def test_in_flight_admissions_count_against_capacity() -> None:
    log = Log()
    for agent in ("a", "b", "c"):
        log.spawn(agent)
    state = fold(log)
    assert decide(state, CAP2, NOW, {}) == [
        Admit("a", 0),
        Admit("b", 0),
        Reject("c", 0, AT_CAPACITY),
    ]
    flying = {"a": InFlight(0, 0, admits=True), "b": InFlight(0, 0, admits=True)}
    assert decide(state, CAP2, NOW, flying) == [Reject("c", 0, AT_CAPACITY)]


def test_terminate_frees_capacity() -> None:
    log = Log()
    for agent in ("a", "b"):
        log.spawn(agent)
        admit(log, agent)
    log.status("a", "started")
    log.terminate("a")
    log.spawn("c")
    state = fold(log)
    assert state.holding == 1
    assert state.agents["a"].phase == "ended"
    assert decide(state, CAP2, NOW, {}) == [Admit("c", 0)]


def test_a_rejection_without_its_terminate_is_finished() -> None:
    log = Log()
    log.spawn("a")
    log.status("a", "rejected", AT_CAPACITY)
    assert decide(fold(log), CAP2, NOW, {}) == [Finish("a", 0, "rejected", AT_CAPACITY)]
    log.terminate("a", "rejected")
    assert decide(fold(log), CAP2, NOW, {}) == []


def test_parent_at_its_child_limit_from_its_own_spawn() -> None:
    log = Log()
    log.spawn("boss", limits={"per_parent": {"max_children": 1}})
    admit(log, "boss")
    log.spawn("kid1", parent="boss")
    admit(log, "kid1")
    log.spawn("kid2", parent="boss")
    assert decide(fold(log), limits(), NOW, {}) == [Reject("kid2", 0, MAX_CHILDREN)]


def test_a_spawn_cannot_loosen_the_config() -> None:
    log = Log()
    log.spawn("boss", limits={"per_parent": {"max_children": 50}})
    admit(log, "boss")
    log.spawn("kid1", parent="boss")
    admit(log, "kid1")
    log.spawn("kid2", parent="boss")
    strict = limits(per_parent={"max_children": 1})
    assert decide(fold(log), strict, NOW, {}) == [Reject("kid2", 0, MAX_CHILDREN)]


def test_depth_limit_names_the_limit() -> None:
    log = Log()
    log.spawn("root", limits={"per_tree": {"max_depth": 1}})
    log.spawn("kid", parent="root")
    log.spawn("grandkid", parent="kid")
    decisions = decide(fold(log), limits(), NOW, {})
    assert decisions[:2] == [Admit("root", 0), Admit("kid", 0)]
    assert isinstance(decisions[2], Reject)
    assert "per_tree.max_depth=1" in decisions[2].error


def test_tree_agent_budget_counts_forks_and_nesting() -> None:
    log = Log()
    log.spawn("root", limits={"per_tree": {"max_agents": 2}})
    admit(log, "root")
    log.spawn("kid", parent="root")
    admit(log, "kid")
    log.fork("kid-fork", source="kid")
    decisions = decide(fold(log), limits(), NOW, {})
    assert len(decisions) == 1
    assert isinstance(decisions[0], Reject)
    assert "per_tree.max_agents=2" in decisions[0].error
    assert fold(log).agents["kid-fork"].tree_id == "root"


def test_tree_token_budget_rejects_new_spawns_and_stops_runners() -> None:
    log = Log()
    log.spawn("root", limits={"per_tree": {"max_tokens": 100}})
    admit(log, "root")
    log.status("root", "started")
    log.spawn("kid", parent="root")
    admit(log, "kid")
    log.status("kid", "started")
    log.terminate("kid", usage={"tokens": 70})
    log.status("root", "checkpoint", tokens=40)
    log.spawn("kid2", parent="root")
    decisions = decide(fold(log), limits(), NOW, {})
    assert isinstance(decisions[0], Reject)
    assert "per_tree.max_tokens=100" in decisions[0].error
    assert isinstance(decisions[1], Notice)
    assert decisions[1].agent_id == "root"


def test_rate_limit_queues_and_admits_in_arrival_order() -> None:
    rate = limits(**{"global": {"max_spawn_rate": 1}})
    log = Log()
    for agent in ("a", "b", "c"):
        log.spawn(agent)
    first = decide(fold(log), rate, NOW, {})
    assert first == [
        Admit("a", 0),
        Queue("b", 0, "global.max_spawn_rate=1.0/s"),
        Queue("c", 0, "global.max_spawn_rate: waiting in line"),
    ]
    admit(log, "a", at=0.0, global_rate=1.0)
    log.status("b", "queued")
    log.status("c", "queued")
    state = fold(log)
    assert decide(state, rate, NOW + 0.5, {}) == []
    assert decide(state, rate, NOW + 1.0, {}) == [Admit("b", 5)]


def test_runtime_limit_gives_notice_then_stops_after_grace() -> None:
    log = Log()
    log.spawn("a", limits={"per_agent": {"max_runtime": 5}})
    admit(log, "a")
    log.status("a", "started", at=0.0)
    assert decide(fold(log), limits(), NOW + 4, {}) == []
    notice = decide(fold(log), limits(), NOW + 6, {})
    assert [type(d) for d in notice] == [Notice]
    log.status("a", "timeout_notice", at=6.0)
    assert decide(fold(log), limits(), NOW + 7, {}, grace_s=2) == []
    stop = decide(fold(log), limits(), NOW + 8, {}, grace_s=2)
    assert stop == [TimeOut("a", 0, "max_runtime 5s exceeded (per_agent.max_runtime)")]


def test_spawn_timeout_is_a_runtime_limit() -> None:
    log = Log()
    log.spawn("a", timeout=1)
    admit(log, "a")
    log.status("a", "started")
    assert [type(d) for d in decide(fold(log), limits(), NOW + 2, {})] == [Notice]


def test_per_agent_tokens_over_limit() -> None:
    log = Log()
    log.spawn("a")
    admit(log, "a")
    log.status("a", "started")
    log.status("a", "checkpoint", tokens=501)
    strict = limits(per_agent={"max_tokens": 500})
    decisions = decide(fold(log), strict, NOW, {})
    assert decisions == [Notice("a", "max_tokens 500 exceeded (per_agent.max_tokens)")]


def test_pause_all_queues_everything_until_resume_all() -> None:
    log = Log()
    log.control("ops", "pause_all")
    log.spawn("a")
    log.spawn("b")
    paused = decide(fold(log), limits(), NOW, {})
    assert [type(d) for d in paused] == [Queue, Queue]
    log.status("a", "queued")
    log.status("b", "queued")
    assert decide(fold(log), limits(), NOW, {}) == []
    log.control("ops", "resume_all")
    assert decide(fold(log), limits(), NOW, {}) == [Admit("a", 4), Admit("b", 5)]


def test_stop_before_start_cancels() -> None:
    log = Log()
    log.spawn("a")
    admit(log, "a")
    log.control("a", "stop", reason="changed my mind")
    state = fold(log)
    assert decide(state, limits(), NOW, {}) == [Cancel("a", 2, "changed my mind")]
    log.status("a", "stopped", "changed my mind")
    assert decide(fold(log), limits(), NOW, {}) == [Finish("a", 0, "cancelled", "changed my mind")]


def test_resume_of_a_stopped_agent_is_admitted_again() -> None:
    log = Log()
    log.spawn("a")
    admit(log, "a")
    log.status("a", "started")
    log.terminate("a", "stopped")
    log.control("a", "resume", message="carry on")
    state = fold(log)
    assert decide(state, limits(), NOW, {}) == [Admit("a", 3, "resume", "carry on")]
    assert state.agents["a"].terminate_seq == 4


def test_rejected_agents_cannot_be_resumed() -> None:
    log = Log()
    log.spawn("a")
    log.status("a", "rejected", AT_CAPACITY)
    log.terminate("a", "rejected")
    log.control("a", "resume")
    assert decide(fold(log), limits(), NOW, {}) == []


def test_decisions_are_guarded_by_the_latest_status_sequence() -> None:
    log = Log()
    log.spawn("a")
    log.status("a", "checkpoint")
    assert decide(fold(log), CAP2, NOW, {}) == [Admit("a", 2)]


def test_a_second_spawn_of_a_known_agent_changes_nothing() -> None:
    log = Log()
    log.spawn("a")
    admit(log, "a")
    log.spawn("a")
    state = fold(log)
    assert state.agents["a"].phase == "admitted"
    assert decide(state, CAP2, NOW, {}) == []


def test_resource_status_for_an_agent() -> None:
    log = Log()
    log.spawn("boss", limits={"per_parent": {"max_children": 3}})
    admit(log, "boss")
    log.status("boss", "started", at=0)
    log.spawn("kid", parent="boss")
    admit(log, "kid")
    answer = resource_status(fold(log), CAP2, "boss", NOW + 2.5)
    assert answer["global"] == {
        "agents_running": 2,
        "capacity": 2,
        "utilization": 1.0,
        "queued": 0,
        "paused": False,
    }
    assert answer["self"]["children_running"] == 1
    assert answer["self"]["children_limit"] == 3
    assert answer["self"]["runtime_elapsed"] == 2.5


def test_rows_round_trip_keeps_order_and_counts() -> None:
    log = Log()
    log.spawn("root", limits={"per_tree": {"max_agents": 9}})
    for agent in ("a", "b", "c"):
        log.spawn(agent, parent="root")
    admit(log, "root")
    admit(log, "b")
    log.control("ops", "pause_all")
    state = fold(log)
    rows = {k: v for k, v in state.take_dirty().items() if v is not None}
    again = GovernorState.from_rows(rows)
    assert list(again.agents) == ["root", "a", "b", "c"]
    assert again.holding == 2
    assert again.agents["root"].children_holding == 1
    assert list(again.undecided) == ["a", "c"]
    assert again.paused
    assert again.trees["root"].agents == 2
    assert decide(again, CAP2, NOW, {}) == decide(state, CAP2, NOW, {})


def test_stored_rows_read_back_as_the_state_even_after_a_forged_infinite_rate() -> None:
    # An admission's rates are details (any JSON): one that says Infinity must not put a
    # number into a row that JSON cannot hold (orjson would write null, and the reload fail).
    log = Log()
    log.spawn("root")
    log.spawn("kid", parent="root")
    admit(log, "root", global_rate=float("inf"))
    admit(log, "kid", at=1.0, global_rate=2.0, parent_rate=float("inf"))
    state = fold(log)
    stored = {k: orjson.loads(v) for k, v in state.take_dirty_json().items() if v is not None}
    again = GovernorState.from_rows(stored)
    assert again == state
    assert decide(again, CAP2, NOW, {}) == decide(state, CAP2, NOW, {})


# -- the `spawn` capability, enforced by the governor ------------------------------------------


def spawn_with(log: Log, agent_id: str, parent: str | None = None, **config: Any) -> None:
    log.add(
        SpawnEvent(
            event_id=new_id(),
            agent_id=agent_id,
            parent=parent,
            task=f"task of {agent_id}",
            config=AgentConfig(runtime="command", command=["true"], **config),
            timestamp=T0,
        )
    )


def ask(log: Log, agent_id: str, request_id: str, capability: str, **kw: Any) -> None:
    log.add(
        HitlEvent(
            event_id=new_id(),
            agent_id=agent_id,
            action="request",
            request_id=request_id,
            kind=kw.pop("kind", "permission"),
            prompt=f"may {agent_id} use {capability}?",
            capability=capability,
            timestamp=T0,
            **kw,
        )
    )


def answer(log: Log, agent_id: str, request_id: str, text: str, by: str = "caller") -> None:
    log.add(
        HitlEvent(
            event_id=new_id(),
            agent_id=agent_id,
            action="response",
            request_id=request_id,
            answer=text,
            by=by,
            timestamp=T0,
        )
    )


NO_LIMITS = limits()


def test_the_permission_rules_shared_by_router_and_governor() -> None:
    assert effective_permissions(None, None) is None
    assert effective_permissions(None, ["net", "fs.read", "net"]) == ["fs.read", "net"]
    assert effective_permissions(["fs.read"], None) == ["fs.read"]
    assert effective_permissions(["fs.read", "spawn"], ["spawn", "shell"]) == ["spawn"]
    assert holds(None, [], "spawn")
    assert holds([], ["spawn"], "spawn")
    assert not holds(["fs.read"], ["shell"], "spawn")
    assert spawn_refusal("p", ["spawn"], []) is None
    refusal = spawn_refusal("p", ["fs.read"], ["shell"])
    assert refusal is not None
    assert "parent p does not hold the 'spawn' permission (it holds: fs.read, shell)" in refusal


def test_a_child_of_a_parent_without_spawn_is_rejected_naming_the_permission() -> None:
    log = Log()
    spawn_with(log, "root", permissions=["fs.read"])
    admit(log, "root")
    spawn_with(log, "kid", parent="root")
    state = fold(log)
    assert state.agents["root"].permissions == ["fs.read"]
    [decision] = decide(state, NO_LIMITS, NOW, {})
    assert isinstance(decision, Reject)
    assert decision.agent_id == "kid"
    assert "parent root does not hold the 'spawn' permission" in decision.error


def test_spawn_by_default_and_by_intersection() -> None:
    log = Log()
    spawn_with(log, "root")  # a root without permissions holds every capability
    spawn_with(log, "kid", parent="root")  # inherits them: may spawn too
    spawn_with(log, "grandkid", parent="kid", permissions=["spawn", "fs.read"])
    spawn_with(log, "tight", parent="grandkid", permissions=["fs.read", "net"])
    spawn_with(log, "refused", parent="tight")
    state = fold(log)
    assert [state.agents[a].permissions for a in ("root", "kid", "grandkid", "tight")] == [
        None,
        None,
        ["fs.read", "spawn"],
        ["fs.read"],
    ]
    decisions = decide(state, NO_LIMITS, NOW, {})
    assert [type(d).__name__ for d in decisions] == ["Admit"] * 4 + ["Reject"]
    assert decisions[-1].agent_id == "refused"


def test_an_approved_permission_request_lets_that_agent_alone_spawn() -> None:
    log = Log()
    spawn_with(log, "root", permissions=["fs.read"])
    spawn_with(log, "sibling", parent="root", permissions=["spawn"])  # root lacks it: none
    ask(log, "root", "r1", "spawn", agent_path=["root"])
    answer(log, "root", "r1", "Approve")
    spawn_with(log, "kid", parent="root")
    spawn_with(log, "nephew", parent="sibling")
    state = fold(log)
    assert state.agents["root"].granted == ["spawn"]
    assert state.agents["kid"].permissions == ["fs.read"]  # a grant is not inherited
    verdicts = {d.agent_id: d for d in decide(state, NO_LIMITS, NOW, {})}
    assert isinstance(verdicts["kid"], Admit)
    assert isinstance(verdicts["sibling"], Reject)  # spawned before the grant
    assert isinstance(verdicts["nephew"], Reject)
    assert "parent sibling does not hold the 'spawn' permission" in verdicts["nephew"].error


def test_denied_forged_and_second_answers_grant_nothing() -> None:
    log = Log()
    spawn_with(log, "root", permissions=[])
    spawn_with(log, "other", permissions=[])
    ask(log, "root", "denied", "spawn")
    answer(log, "root", "denied", "deny")
    answer(log, "root", "denied", "approve")  # the first answer stands
    ask(log, "root", "about-other", "spawn")
    answer(log, "other", "about-other", "approve")  # published about another agent
    ask(log, "root", "outsider", "spawn")
    answer(log, "root", "outsider", "approve", by="other")  # an agent of another tree
    ask(log, "root", "question", "spawn", kind="question")
    answer(log, "root", "question", "yes")  # a question grants nothing
    spawn_with(log, "kid", parent="root")
    state = fold(log)
    assert state.agents["root"].granted == []
    assert isinstance(decide(state, NO_LIMITS, NOW, {})[-1], Reject)


def test_the_rejection_is_the_same_replayed_and_reloaded_from_rows() -> None:
    log = Log()
    spawn_with(log, "root", permissions=["fs.read"])
    spawn_with(log, "early", parent="root")
    ask(log, "root", "r1", "spawn")
    answer(log, "root", "r1", "yes")
    spawn_with(log, "late", parent="root")
    state = fold(log)
    expected = decide(state, NO_LIMITS, NOW, {})
    assert [type(d).__name__ for d in expected] == ["Admit", "Reject", "Admit"]
    assert decide(fold(log), NO_LIMITS, NOW, {}) == expected
    rows = {k: v for k, v in state.take_dirty().items() if v is not None}
    again = GovernorState.from_rows(rows)
    assert again.agents == state.agents
    assert again.requests == state.requests
    assert decide(again, NO_LIMITS, NOW, {}) == expected


def test_a_fork_keeps_its_source_s_own_limits_and_may_only_tighten_them() -> None:
    log = Log()
    log.spawn("source", limits={"per_agent": {"max_runtime": 5, "max_tokens": 1000}})
    admit(log, "source")
    own = limits(per_agent={"max_tokens": 100, "max_runtime": 60})
    log.add(
        ForkEvent(
            event_id=new_id(),
            agent_id="fork",
            source_agent="source",
            reason="try",
            timestamp=T0,
            config=AgentConfig(runtime="command", command=["true"], resource_limits=own),
        )
    )
    log.fork("plain-fork", source="source")
    state = fold(log)
    tightened = effective_agent_limits(state, limits(), state.agents["fork"])
    assert (tightened.max_runtime, tightened.max_tokens) == (5, 100)
    inherited = effective_agent_limits(state, limits(), state.agents["plain-fork"])
    assert (inherited.max_runtime, inherited.max_tokens) == (5, 1000)

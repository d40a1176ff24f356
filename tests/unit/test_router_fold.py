"""The router's fold: given these events, then these subscriptions, inboxes and requests."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from grove_core.records import Recorded
from grove_events import AgentConfig, HitlEvent, MessageEvent, SpawnEvent, new_id
from grove_router.domain import INJECTED_PRIORITY, RouterState, effective_permissions, evolve
from tests.unit.helpers import T0, Log

pytestmark = pytest.mark.unit


class RoutingLog(Log):
    """The helpers' log with messages, HITL events and permissions."""

    def spawn_with(
        self,
        agent_id: str,
        parent: str | None = None,
        *,
        permissions: list[str] | None = None,
        **kw: Any,
    ) -> Recorded:
        config = AgentConfig(runtime="command", command=["true"], permissions=permissions)
        return self.add(
            SpawnEvent(
                event_id=new_id(),
                agent_id=agent_id,
                parent=parent,
                task=f"task of {agent_id}",
                config=config,
                timestamp=T0,
                **kw,
            )
        )

    def message(self, sender: str, content: str, at: float = 0.0, **kw: Any) -> Recorded:
        return self.add(
            MessageEvent(
                event_id=new_id(),
                agent_id=sender,
                timestamp=T0 + timedelta(seconds=at),
                content=content,
                **{"from": sender},
                **kw,
            )
        )

    def ask(self, agent_id: str, request_id: str, **kw: Any) -> Recorded:
        return self.add(
            HitlEvent(
                event_id=new_id(),
                agent_id=agent_id,
                timestamp=T0,
                action="request",
                request_id=request_id,
                prompt=kw.pop("prompt", "which way?"),
                **kw,
            )
        )

    def answer(self, agent_id: str, request_id: str, answer: str, by: str = "caller") -> Recorded:
        return self.add(
            HitlEvent(
                event_id=new_id(),
                agent_id=agent_id,
                timestamp=T0,
                action="response",
                request_id=request_id,
                answer=answer,
                by=by,
            )
        )


def fold(log: Log, message_rate: float | None = None) -> RouterState:
    state = RouterState()
    for recorded in log.records:
        state = evolve(state, recorded, message_rate)
    return state


def inbox_types(state: RouterState, agent_id: str) -> list[tuple[str, str]]:
    """(event type, the subscription it came by) of each entry, in inbox order."""
    return [(e.type, e.via) for e in state.inbox(agent_id)]


def running_tree() -> RoutingLog:
    log = RoutingLog()
    log.spawn_with("root")
    log.spawn_with("kid", parent="root")
    log.spawn_with("grandkid", parent="kid")
    for agent in ("root", "kid", "grandkid"):
        log.status(agent, "started")
    return log


def test_spawns_subscribe_parent_child_and_self() -> None:
    log = running_tree()
    log.spawn_with("quiet", parent="root", subscribe_parent=False, subscriptions=["topic:news"])
    state = fold(log)
    assert state.routes["root"].subscriptions == ["agent:root", "subtree:kid"]
    assert state.routes["kid"].subscriptions == ["agent:kid", "lineage:kid", "subtree:grandkid"]
    assert state.routes["quiet"].subscriptions == ["agent:quiet", "lineage:quiet", "topic:news"]
    assert state.subscribers["topic:news"] == {"quiet"}


def test_a_parent_receives_its_child_s_result_but_not_its_progress() -> None:
    log = running_tree()
    log.status("kid", "checkpoint", "halfway")
    log.terminate("grandkid", "completed")
    log.terminate("kid", "completed")
    state = fold(log)
    assert inbox_types(state, "root") == [("terminate", "subtree:kid")]
    assert inbox_types(state, "kid") == [("terminate", "subtree:grandkid")]
    # The grandkid had ended when its parent did: that notice waits for its next start.
    assert inbox_types(state, "grandkid") == []
    assert [e.via for e in state.routes["grandkid"].held] == ["lineage:grandkid"]


def test_a_child_s_failure_reaches_its_manager_but_its_progress_does_not() -> None:
    log = running_tree()
    log.spawn_with("loner", parent="kid", subscribe_parent=False)
    log.status("grandkid", "checkpoint", "tried the front door")
    log.status(
        "grandkid",
        "failed",
        "RuntimeError: locked",
        error="RuntimeError: locked",
        attempted=["tried the front door"],
        partial_results=["half a map"],
    )
    log.terminate("grandkid", "failed")
    log.status("loner", "failed", "also failed")
    state = fold(log)
    assert inbox_types(state, "kid") == [
        ("status", "subtree:grandkid"),
        ("terminate", "subtree:grandkid"),
    ]
    failed = state.inbox("kid")[0]
    assert (failed.seq, failed.source) == (log.records[-3].seq, "grandkid")
    # Only the manager subscribes to its child's subtree; nothing is echoed to the child.
    assert inbox_types(state, "root") == []
    assert inbox_types(state, "grandkid") == []


def test_a_failure_reaches_a_task_subscriber_and_a_manager_once() -> None:
    log = running_tree()
    log.spawn_with("watcher", subscriptions=["task:grandkid", "subtree:grandkid"])
    log.status("watcher", "started")
    log.status("grandkid", "failed", "broke")
    state = fold(log)
    assert inbox_types(state, "watcher") == [("status", "task:grandkid")]
    assert inbox_types(state, "kid") == [("status", "subtree:grandkid")]


def test_lineage_brings_ancestors_announcements_and_ends() -> None:
    log = running_tree()
    log.message("root", "everyone below: stop at noon", topic="plans")
    log.terminate("root", "stopped")
    state = fold(log)
    assert inbox_types(state, "kid") == [("message", "lineage:kid"), ("terminate", "lineage:kid")]
    assert inbox_types(state, "grandkid") == [
        ("message", "lineage:grandkid"),
        ("terminate", "lineage:grandkid"),
    ]
    assert inbox_types(state, "root") == []


def test_topics_broadcast_and_task_subscriptions() -> None:
    log = RoutingLog()
    log.spawn_with("a", subscriptions=["topic:news", "task:b"])
    log.spawn_with("b", subscriptions=["broadcast:all"])
    log.spawn_with("c")
    for agent in ("a", "b", "c"):
        log.status(agent, "started")
    log.message("c", "headline", topic="news")
    log.message("c", "to all", topic="all")
    log.status("b", "discovery", "found it")
    log.control("c", "pause_all")
    state = fold(log)
    # task:b brings every status of b: its start, then its discovery.
    assert inbox_types(state, "a") == [
        ("status", "task:b"),
        ("message", "topic:news"),
        ("status", "task:b"),
    ]
    assert inbox_types(state, "b") == [("message", "broadcast:all"), ("control", "broadcast:all")]
    assert inbox_types(state, "c") == []


def test_messages_to_an_agent_are_not_echoed_to_the_sender() -> None:
    log = running_tree()
    log.message("kid", "hello", to="grandkid")
    log.message("kid", "note to self", to="kid")
    state = fold(log)
    entry = state.inbox("grandkid")[0]
    assert (entry.type, entry.source, entry.agent_path) == ("message", "kid", ["root", "kid"])
    assert inbox_types(state, "kid") == []


def test_held_messages_are_delivered_at_start_by_priority_without_the_expired() -> None:
    log = RoutingLog()
    log.spawn_with("sender")
    log.spawn_with("late")
    low = log.message("sender", "low", to="late", priority=-1)
    high = log.message("sender", "high", to="late", priority=5)
    log.message("sender", "stale", to="late", ttl=1, at=0.0)
    fresh = log.message("sender", "fresh", to="late", ttl=100, at=0.0)
    log.control("late", "inject_message", message="read me first")
    state = fold(log)
    assert state.inbox("late") == []
    assert len(state.routes["late"].held) == 5
    log.status("late", "started", at=10.0)
    state = fold(log)
    entries = state.inbox("late")
    assert [e.seq for e in entries] == [
        log.records[6].seq,
        high.seq,
        fresh.seq,
        low.seq,
    ]
    assert entries[0].injected
    assert entries[0].priority == INJECTED_PRIORITY
    assert [e.index for e in entries] == [1, 2, 3, 4]
    assert state.routes["late"].held == []


def test_an_ended_agent_s_mail_waits_for_its_next_instance() -> None:
    log = running_tree()
    log.terminate("kid", "stopped")
    log.message("root", "are you there?", to="kid")
    state = fold(log)
    assert [e.type for e in state.routes["kid"].held] == ["message"]
    log.status("kid", "started")
    state = fold(log)
    assert [e.type for e in state.inbox("kid")][-1] == "message"


def test_a_question_goes_to_every_ancestor_and_the_answer_to_the_asker_only() -> None:
    log = running_tree()
    log.spawn_with("sibling", parent="kid")
    log.status("sibling", "started")
    log.ask("grandkid", "q1", agent_path=["root", "kid", "grandkid"], summary="short")
    state = fold(log)
    assert [r.request_id for r in state.pending_requests(tree_id="root")] == ["q1"]
    assert inbox_types(state, "root") == [("hitl", "subtree:kid")]
    assert inbox_types(state, "kid") == [("hitl", "subtree:grandkid")]
    log.answer("grandkid", "q1", "left")
    log.answer("grandkid", "q1", "right")
    state = fold(log)
    assert state.pending_requests() == []
    assert state.requests["q1"].answer == "left"
    assert inbox_types(state, "grandkid") == [("hitl", "agent:grandkid")]
    assert len(state.inbox("kid")) == 1
    assert len(state.inbox("root")) == 1
    assert state.inbox("sibling") == []


def test_a_question_reaches_ancestors_even_without_parent_subscriptions() -> None:
    log = RoutingLog()
    log.spawn_with("root")
    log.spawn_with("kid", parent="root", subscribe_parent=False)
    log.status("root", "started")
    log.ask("kid", "q1")
    state = fold(log)
    assert inbox_types(state, "root") == [("hitl", "ancestor")]
    assert state.requests["q1"].agent_path == ["root", "kid"]


def test_permissions_intersect_down_the_tree() -> None:
    log = RoutingLog()
    log.spawn_with("root")
    log.spawn_with("limited", parent="root", permissions=["spawn", "fs.read", "shell"])
    log.spawn_with("narrower", parent="limited", permissions=["fs.read", "net"])
    log.spawn_with("inherits", parent="limited")
    log.spawn_with("none", parent="limited", permissions=[])
    state = fold(log)
    assert state.routes["root"].permissions is None
    assert state.routes["limited"].permissions == ["fs.read", "shell", "spawn"]
    assert state.routes["narrower"].permissions == ["fs.read"]
    assert state.routes["inherits"].permissions == ["fs.read", "shell", "spawn"]
    assert state.routes["none"].permissions == []
    assert effective_permissions(None, None) is None


def test_an_approved_permission_request_grants_the_capability_to_that_agent_only() -> None:
    log = RoutingLog()
    log.spawn_with("root", permissions=["fs.read"])
    log.spawn_with("kid", parent="root", permissions=["fs.read"])
    log.ask("kid", "p1", kind="permission", capability="shell", prompt="may I?")
    log.ask("kid", "p2", kind="permission", capability="net", prompt="and this?")
    log.answer("kid", "p1", " Approve ")
    log.answer("kid", "p2", "no")
    state = fold(log)
    assert state.routes["kid"].granted == ["shell"]
    assert state.routes["kid"].holds("shell")
    assert not state.routes["kid"].holds("net")
    assert not state.routes["root"].holds("shell")


def test_a_fork_keeps_its_source_s_subscriptions_and_capabilities() -> None:
    log = running_tree()
    log.spawn_with("worker", parent="root", permissions=["fs.read"], subscriptions=["topic:x"])
    log.fork("worker-fork", source="worker")
    state = fold(log)
    fork = state.routes["worker-fork"]
    assert fork.subscriptions == ["agent:worker-fork", "lineage:worker-fork", "topic:x"]
    assert fork.permissions == ["fs.read"]
    assert "subtree:worker-fork" in state.routes["root"].subscriptions


def test_committed_cursor_comes_from_the_agent_s_status() -> None:
    log = running_tree()
    log.message("root", "one", to="kid")
    log.message("root", "two", to="kid")
    log.status("kid", "checkpoint", "read one", inbox_cursor=1)
    log.status("kid", "checkpoint", "stale", inbox_cursor=0)
    state = fold(log)
    assert state.routes["kid"].committed == 1


def test_rows_rebuild_the_same_state_and_a_replay_the_same_rows() -> None:
    log = running_tree()
    log.message("root", "hello", to="kid", priority=3)
    log.ask("grandkid", "q1")
    log.terminate("kid", "stopped")
    log.message("root", "later", to="kid")
    state = fold(log)
    rows = {k: v for k, v in state.take_dirty().items() if v is not None}
    again = RouterState.from_rows(rows)
    assert again.routes == state.routes
    assert again.inboxes == state.inboxes
    assert again.requests == state.requests
    assert again.subscribers == state.subscribers
    assert again.tree.agents == state.tree.agents
    replayed = fold(log)
    assert {k: v for k, v in replayed.take_dirty().items() if v is not None} == rows


def test_a_replayed_event_changes_nothing() -> None:
    log = running_tree()
    spawn = log.records[0]
    log.message("root", "hello", to="kid")
    state = fold(log)
    before = (list(state.routes["root"].subscriptions), len(state.inbox("kid")))
    state = evolve(state, Recorded(spawn.seq, spawn.subject, spawn.event))
    assert (state.routes["root"].subscriptions, len(state.inbox("kid"))) == before


def test_an_agent_of_another_tree_cannot_answer_and_nor_can_a_misaddressed_answer() -> None:
    log = running_tree()
    log.spawn_with("stranger")
    log.status("stranger", "started")
    log.ask("grandkid", "q1", agent_path=["root", "kid", "grandkid"])
    log.answer("grandkid", "q1", "from outside", by="stranger")
    log.answer("kid", "q1", "to the wrong agent")
    state = fold(log)
    assert [r.request_id for r in state.pending_requests()] == ["q1"]
    assert inbox_types(state, "grandkid") == []
    log.answer("grandkid", "q1", "from the manager", by="kid")
    state = fold(log)
    assert state.requests["q1"].answer == "from the manager"


# -- the global message rate ------------------------------------------------------------------


def test_messages_over_the_rate_are_paced_in_log_order_not_dropped() -> None:
    log = running_tree()
    for i in range(20):
        log.message("root", f"m{i}", to="kid")
    log.terminate("grandkid", "completed")
    log.message("root", "after a pause", to="kid", at=10.0)
    state = fold(log, message_rate=5)
    entries = state.inbox("kid")
    assert [e.type for e in entries] == ["message"] * 20 + ["terminate", "message"]
    # A burst of five at once, then one every 1/5 s; the rate has refilled ten seconds later.
    assert [e.not_before for e in entries[:5]] == [None] * 5
    for k, entry in enumerate(entries[5:20], start=1):
        due = entry.due_at()
        assert due is not None
        assert abs((due - T0).total_seconds() - 0.2 * k) < 1e-3
    assert entries[20].not_before is None
    assert entries[21].not_before is None


def test_an_inbox_is_served_up_to_the_first_entry_held_back() -> None:
    log = running_tree()
    for i in range(20):
        log.message("root", f"m{i}", to="kid")
    log.terminate("grandkid", "completed")
    state = fold(log, message_rate=5)
    entries = state.inbox("kid")
    half_second = T0 + timedelta(seconds=0.5)
    assert state.inbox("kid", now=half_second) == entries[:7]
    assert state.held_back("kid", 0, half_second) is entries[7]
    assert state.inbox("kid", 7, now=half_second) == []
    # The terminate needs no pacing, but it waits behind the paced messages before it.
    later = T0 + timedelta(seconds=3.1)
    assert state.inbox("kid", 7, now=later) == entries[7:]
    assert state.held_back("kid", 7, later) is None
    assert state.inbox("kid", 7, limit=2, now=later) == entries[7:9]


def test_the_pace_follows_the_log_s_time_not_the_sender_s() -> None:
    """A sender's clock, wrong or forged, moves neither its own message nor anyone's after it."""
    log = running_tree()
    log.message("root", "dated a century ahead", to="kid", at=100 * 365 * 86400.0)
    log.message("root", "dated a day behind", to="kid", at=-86400.0)
    for i in range(3):
        log.message("root", f"m{i}", to="kid")
    # Each was stored a tenth of a second after the one before, whatever its sender wrote on it.
    for k, index in enumerate(range(len(log.records) - 5, len(log.records))):
        log.records[index] = log.records[index]._replace(stored_at=T0 + timedelta(seconds=0.1 * k))
    state = fold(log, message_rate=5)
    due = [entry.due_at() for entry in state.inbox("kid")]
    # A burst of five, all within it: nothing is held back, not until 2126 nor at all.
    assert due == [None] * 5
    later = T0 + timedelta(seconds=0.5)
    assert state.inbox("kid", now=later) == state.inbox("kid")


def test_without_a_message_rate_nothing_is_paced() -> None:
    log = running_tree()
    for i in range(50):
        log.message("root", f"m{i}", to="kid")
    state = fold(log)
    assert all(e.not_before is None for e in state.inbox("kid"))
    assert state.take_dirty().get("pace:messages") is None


def test_the_pace_is_the_same_on_replay_and_from_stored_rows() -> None:
    log = running_tree()
    log.spawn_with("late")
    for i in range(6):
        log.message("root", f"m{i}", to="kid")
        log.message("root", f"to late {i}", to="late", priority=i)
    head = len(log.records)
    stored = fold(log, message_rate=2)
    rows = {k: v for k, v in stored.take_dirty().items() if v is not None}
    for i in range(4):
        log.message("root", f"n{i}", to="kid", at=1.0)
    log.status("late", "started", at=2.0)
    whole = fold(log, message_rate=2)
    resumed = RouterState.from_rows(rows)
    for recorded in log.records[head:]:
        resumed = evolve(resumed, recorded, 2)
    assert resumed.inboxes == whole.inboxes
    assert resumed.pace == whole.pace
    assert fold(log, message_rate=2).inboxes == whole.inboxes
    # Held for an agent not running, a paced message keeps its moment when it is delivered.
    late = whole.inbox("late")
    assert [e.priority for e in late] == [5, 4, 3, 2, 1, 0]
    assert sum(e.not_before is not None for e in late) == 5


def test_events_the_router_does_not_take_say_why() -> None:
    log = running_tree()
    log.spawn_with("other")
    log.ask("grandkid", "q1")
    steps: list[tuple[Recorded, str | None]] = [
        (log.terminate("ghost"), "terminate of ghost, an agent the log never spawned"),
        (log.answer("grandkid", "nope", "yes"), "answer to nope, a request the log does not"),
        (log.answer("kid", "q1", "yes"), "answer to q1 was published about kid, not the asker"),
        (log.answer("grandkid", "q1", "yes", by="other"), "may not answer a question of tree root"),
        (log.answer("grandkid", "q1", "left", by="root"), None),
        (log.answer("grandkid", "q1", "right"), "second answer to q1"),
    ]
    state = RouterState()
    seen = 0
    for recorded in log.records:
        state = evolve(state, recorded)
        for step, expected in steps:
            if step is recorded:
                seen += 1
                if expected is None:
                    assert state.refused is None
                else:
                    assert state.refused is not None
                    assert expected in state.refused
    assert seen == len(steps)
    assert state.requests["q1"].answer == "left"
    assert "ghost" not in state.routes

"""The spawner's pure parts: session openings, the fork copy, starts, peers; the session store."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from agentgrove.context import SessionEntry
from grove_core.records import Recorded
from grove_core.settings import ServiceSettings
from grove_events import AgentConfig, ForkEvent, SpawnEvent, StatusEvent, StatusPayload, new_id
from grove_spawner.domain import PeerWatch, SpawnerState, evolve, fork_spawn, start_allowed
from grove_spawner.sessions import (
    SessionOpen,
    SessionOpener,
    SessionStore,
    StoredSession,
    fork_context_message,
    fork_opening,
    sessions_database_url,
    spawn_opening,
)
from tests.unit.helpers import T0, Log

pytestmark = pytest.mark.unit


def spawn_event(agent_id: str = "src", **kw: object) -> SpawnEvent:
    return SpawnEvent(
        event_id=new_id(),
        agent_id=agent_id,
        task=str(kw.pop("task", "find the treasure")),
        config=AgentConfig(runtime="python", entrypoint="tests.lifecycle_agents:remembers"),
        timestamp=T0,
        **kw,  # type: ignore[arg-type]
    )


def fork_event(at: datetime, **kw: object) -> ForkEvent:
    return ForkEvent(
        event_id=new_id(),
        agent_id="fork",
        timestamp=at,
        source_agent="src",
        reason="try the back door",
        **kw,  # type: ignore[arg-type]
    )


def entry(kind: str, content: str, minutes: int, agent_id: str = "src") -> SessionEntry:
    return SessionEntry(kind, content, T0 + timedelta(minutes=minutes), agent_id)  # type: ignore[arg-type]


# -- openings ---------------------------------------------------------------------------------


def test_a_new_session_opens_with_the_initial_context_and_the_task() -> None:
    spawn = spawn_event(initial_context="you are careful")
    opening = spawn_opening(spawn, T0)
    assert [(e.kind, e.content) for e in opening] == [
        ("system", "you are careful"),
        ("user", "find the treasure"),
    ]


def test_a_fork_copies_the_source_up_to_the_fork_then_says_it_is_a_fork() -> None:
    source = [
        entry("user", "find the treasure", 0),
        entry("assistant", "step 1", 1),
        entry("tool_result", "found a clue", 2),
        entry("assistant", "after the fork", 10),
    ]
    fork = fork_event(T0 + timedelta(minutes=5), initial_message="look behind the house")

    opening = fork_opening(source, fork, T0 + timedelta(minutes=6))

    assert opening[:3] == source[:3]
    system, message = opening[3:]
    assert system.kind == "system"
    assert system.agent_id == "fork"
    assert system.content == fork_context_message("src", "try the back door")
    assert (message.kind, message.content) == ("user", "look behind the house")


def test_the_fork_context_names_the_source_the_reason_and_that_the_source_goes_on() -> None:
    text = fork_context_message("agent-7", "compare two plans")
    assert "fork of agent agent-7" in text
    assert "compare two plans" in text
    assert "keeps running" in text
    assert "next user message" in fork_context_message("agent-7", "why", task="new task")


def test_a_fork_spawn_runs_beside_its_source_with_the_source_defaults() -> None:
    source = spawn_event(parent="boss", tree_id="root", subscriptions=["topic:news"])
    plain = fork_spawn(fork_event(T0), source)
    assert (plain.agent_id, plain.session_id, plain.parent, plain.tree_id) == (
        "fork",
        "fork",
        "boss",
        "root",
    )
    assert plain.task == source.task
    assert plain.config == source.config
    assert plain.subscriptions == ["topic:news"]
    assert plain.fork_from == "src"

    config = AgentConfig(runtime="command", command=["true"])
    custom = fork_spawn(fork_event(T0, task="other", config=config, subscriptions=[]), source)
    assert (custom.task, custom.config, custom.subscriptions) == ("other", config, [])


# -- starts and peers ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "admitted", "last_terminate", "allowed"),
    [
        ("spawn", 5, None, True),
        ("spawn", 9, 7, False),  # a duplicated admission of an agent that has ended
        ("fork", 5, None, True),
        ("resume", 9, 7, True),
        ("resume", 6, 7, False),  # an admission older than the last end
        ("resume", 5, None, False),  # nothing to resume
    ],
)
def test_which_admissions_may_start_an_instance(
    kind: str, admitted: int, last_terminate: int | None, allowed: bool
) -> None:
    assert start_allowed(kind, admitted, last_terminate) is allowed  # type: ignore[arg-type]


def test_the_fold_keeps_the_start_of_an_instance_through_a_pause() -> None:
    log = Log()
    log.spawn("a")
    started = log.status("a", "started", spawner_id="s1", runtime="command")
    log.status("a", "paused", spawner_id="s1")
    log.status("a", "resumed", spawner_id="s1", **{"from": "pause"})
    state = SpawnerState()
    for recorded in log.records:
        state = evolve(state, recorded)
    (agent,) = state.started_by("s1")
    assert (agent.runtime, agent.started_seq) == ("command", started.seq)


def test_a_resumed_agent_is_tracked_again_from_its_new_start() -> None:
    log = Log()
    log.spawn("a")
    log.status("a", "started", spawner_id="s1", runtime="python")
    log.terminate("a", "stopped")
    again = log.status("a", "started", spawner_id="s2", runtime="python", start="resume")
    state = SpawnerState()
    for recorded in log.records:
        state = evolve(state, recorded)
    assert state.started_by("s1") == []
    assert [a.started_seq for a in state.started_by("s2")] == [again.seq]


def test_a_peer_is_lost_after_the_timeout_without_a_sign_of_life() -> None:
    log = Log()
    for agent, spawner in (("a", "s1"), ("b", "s2"), ("c", "me")):
        log.spawn(agent)
        log.status(agent, "started", spawner_id=spawner, runtime="python")
    state = SpawnerState()
    for recorded in log.records:
        state = evolve(state, recorded)
    watch = PeerWatch(since=100.0)
    watch.hear("s2", 110.0)

    assert watch.lost(state, 114.0, 15.0, "me") == {}
    lost = watch.lost(state, 116.0, 15.0, "me")
    assert {k: [a.agent_id for a in v] for k, v in lost.items()} == {"s1": ["a"]}
    assert watch.silent_for("s1", 116.0) == 16.0
    assert set(watch.lost(state, 126.0, 15.0, "me")) == {"s1", "s2"}


def test_a_status_without_a_spawner_is_not_a_start() -> None:
    state = evolve(
        SpawnerState(),
        Recorded(
            1,
            "grove.status.a",
            StatusEvent(
                event_id=new_id(),
                agent_id="a",
                status_type="started",
                payload=StatusPayload(),
                timestamp=T0,
            ),
        ),
    )
    assert state.running == {}


# -- the store ---------------------------------------------------------------------------------


def test_sessions_live_in_the_shared_database_or_in_the_data_folder(tmp_path: Path) -> None:
    assert sessions_database_url(ServiceSettings(database_url="postgresql://db/grove")) == (
        "postgresql://db/grove"
    )
    default = sessions_database_url(ServiceSettings(data_dir=tmp_path))
    assert default == f"sqlite:///{(tmp_path / 'sessions.db').resolve()}"


async def test_a_session_is_stored_and_resumed_with_its_message(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'sessions.db'}"
    store = SessionStore(url)
    spawn = spawn_event()
    opened = store.open("spawn", spawn, now=T0)
    session = StoredSession(store, "src", "src", opened)
    await session.record("assistant", "step 1")
    await session.record("tool_call", "dig")
    with pytest.raises(ValueError, match="not one of"):
        await session.record("robot", "beep")  # type: ignore[arg-type]
    assert store.open("spawn", spawn, now=T0) == session.entries  # opening twice adds nothing

    other_spawner = SessionStore(url)
    resumed = other_spawner.open("resume", spawn, resume_message="go on", now=T0)

    assert [(e.kind, e.content) for e in resumed] == [
        ("user", "find the treasure"),
        ("assistant", "step 1"),
        ("tool_call", "dig"),
        ("user", "go on"),
    ]
    assert all(e.time.tzinfo is not None for e in resumed)
    assert other_spawner.entries("nobody") == []
    store.close()
    other_spawner.close()


def test_a_fork_session_opens_once_from_the_stored_source(tmp_path: Path) -> None:
    store = SessionStore(f"sqlite:///{tmp_path / 'sessions.db'}")
    now = datetime.now(UTC)
    store.append("src", [entry("user", "find the treasure", 0), entry("assistant", "step 1", 1)])
    fork = fork_event(now, task="count the coins")
    spawn = fork_spawn(fork, spawn_event())

    opened = store.open("fork", spawn, fork=fork, source_session="src", now=now)
    again = store.open("fork", spawn, fork=fork, source_session="src", now=now)

    assert [(e.kind, e.content) for e in opened] == [
        ("user", "find the treasure"),
        ("assistant", "step 1"),
        ("system", fork_context_message("src", "try the back door", "count the coins")),
        ("user", "count the coins"),
    ]
    assert again == store.entries("fork") == opened
    assert [(e.kind, e.content) for e in store.entries("src")] == [
        ("user", "find the treasure"),
        ("assistant", "step 1"),
    ]
    store.close()


def group_of_opens() -> list[SessionOpen]:
    """Opens whose results depend on each other: a spawn, its retry, a fork of it, resumes."""
    later = T0 + timedelta(minutes=5)
    source = spawn_event()
    fork = fork_event(later, task="count the coins")
    return [
        SessionOpen("spawn", source, T0),
        SessionOpen("spawn", source, T0),  # a start tried again finds its opening
        SessionOpen("resume", source, later, resume_message="go on"),
        SessionOpen("fork", fork_spawn(fork, source), later, fork=fork, source_session="src"),
        SessionOpen("spawn", spawn_event("other", task="count the stars"), T0),
        SessionOpen("resume", spawn_event("other"), later),  # no message: adds nothing
    ]


def test_opens_in_one_transaction_give_what_they_give_one_by_one(tmp_path: Path) -> None:
    together = SessionStore(f"sqlite:///{tmp_path / 'together.db'}")
    alone = SessionStore(f"sqlite:///{tmp_path / 'alone.db'}")
    requests = group_of_opens()

    grouped = together.open_many(requests)
    one_by_one = [alone.open_many([request])[0] for request in requests]

    assert grouped == one_by_one
    assert [(e.kind, e.content) for e in grouped[3]] == [
        ("user", "find the treasure"),
        ("user", "go on"),
        ("system", fork_context_message("src", "try the back door", "count the coins")),
        ("user", "count the coins"),
    ]
    for session in ("src", "fork", "other"):
        assert together.entries(session) == alone.entries(session)
    together.close()
    alone.close()


class CountingStore(SessionStore):
    """A real store that records the size of each transaction of opens."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.groups: list[int] = []

    def open_many(self, requests: Sequence[SessionOpen]) -> list[list[SessionEntry]]:
        self.groups.append(len(requests))
        return super().open_many(requests)


async def test_opens_asked_for_together_share_a_transaction_and_a_bad_one_fails_alone(
    tmp_path: Path,
) -> None:
    store = CountingStore(f"sqlite:///{tmp_path / 'sessions.db'}")
    opener = SessionOpener(store)
    requests = group_of_opens()
    broken = SessionOpen("fork", spawn_event("orphan"), T0)  # a fork without its fork event

    results = await asyncio.gather(
        *(opener.open(request) for request in [*requests, broken]), return_exceptions=True
    )

    assert isinstance(results[-1], AssertionError)
    reference = SessionStore(f"sqlite:///{tmp_path / 'reference.db'}")
    assert results[:-1] == reference.open_many(requests)
    reference.close()
    assert store.groups[0] == len(requests) + 1  # all together first, then each alone
    assert len(store.groups) == 1 + len(requests) + 1
    store.close()


@pytest.mark.parametrize(("sync", "level"), [("normal", 1), ("full", 2)])
def test_the_session_file_is_synced_as_configured(tmp_path: Path, sync: str, level: int) -> None:
    store = SessionStore(f"sqlite:///{tmp_path / 'sessions.db'}", sync)  # type: ignore[arg-type]
    with store.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == level
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"

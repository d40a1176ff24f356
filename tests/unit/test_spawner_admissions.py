"""How spawners share admissions: the fold keeps those no instance started from, `owner`
gives each one spawner, `AdmissionDesk` says when a spawner starts one, and heartbeats say
which spawners share them."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from types import SimpleNamespace
from typing import Any

import pytest

from grove_spawner.domain import AdmissionDesk, PeerWatch, SpawnerState, evolve, owner
from grove_spawner.service import Spawner
from tests.unit.helpers import Log

pytestmark = pytest.mark.unit


def folded(log: Log) -> SpawnerState:
    state = SpawnerState()
    for recorded in log.records:
        state = evolve(state, recorded)
    return state


def test_an_admission_waits_until_an_instance_starts_or_the_agent_ends() -> None:
    log = Log()
    for agent in ("a", "b", "c"):
        log.spawn(agent)
    a, b, c = (log.status(agent, "admitted").seq for agent in ("a", "b", "c"))
    assert folded(log).admitted == {"a": a, "b": b, "c": c}

    log.status("b", "started", spawner_id="s1", runtime="python")
    log.terminate("c", "stopped")  # stopped before any spawner started it
    assert folded(log).admitted == {"a": a}


def test_a_copy_of_an_admission_while_an_instance_runs_does_not_wait() -> None:
    log = Log()
    log.spawn("a")
    log.status("a", "admitted")
    log.status("a", "started", spawner_id="s1", runtime="python")
    log.status("a", "admitted")
    assert folded(log).admitted == {}


def test_the_admission_of_a_resume_waits_like_a_first_one() -> None:
    log = Log()
    log.spawn("a")
    log.status("a", "admitted")
    log.status("a", "started", spawner_id="s1", runtime="python")
    log.terminate("a", "stopped")
    resume = log.status("a", "admitted", start="resume")
    assert folded(log).admitted == {"a": resume.seq}


def test_waiting_admissions_are_stored_and_loaded_with_the_started_agents() -> None:
    log = Log()
    log.spawn("a")
    admitted = log.status("a", "admitted")
    log.spawn("b")
    log.status("b", "started", spawner_id="s1", runtime="command")
    state = folded(log)
    rows = {key: row for key, row in state.take_dirty().items() if row is not None}
    loaded = SpawnerState.from_rows(rows)
    assert loaded.admitted == {"a": admitted.seq}
    assert list(loaded.running) == ["b"]

    state = evolve(state, log.status("a", "started", spawner_id="s2", runtime="python"))
    assert state.take_dirty()["~admitted:a"] is None  # the row is deleted


def test_every_spawner_names_the_same_owner_and_the_work_spreads() -> None:
    spawners = ["spawner-1", "spawner-2", "spawner-3"]
    agents = [f"agent-{i}" for i in range(3000)]
    owners = {agent: owner(agent, spawners) for agent in agents}
    assert owners == {agent: owner(agent, reversed(spawners)) for agent in agents}
    counts = Counter(owners.values())
    assert set(counts) == set(spawners)
    assert all(800 < n < 1200 for n in counts.values()), counts
    assert owner("agent-1", []) is None


def test_when_a_spawner_leaves_only_its_own_admissions_move() -> None:
    spawners = ["spawner-1", "spawner-2", "spawner-3"]
    agents = [f"agent-{i}" for i in range(600)]
    before = {agent: owner(agent, spawners) for agent in agents}
    after = {agent: owner(agent, ["spawner-1", "spawner-3"]) for agent in agents}
    moved = {agent for agent in agents if before[agent] != after[agent]}
    assert moved == {agent for agent in agents if before[agent] == "spawner-2"}


def test_a_spawner_starts_what_it_owns_at_once_and_the_rest_once_overdue() -> None:
    sharing = ["me", "peer"]
    waiting = {f"agent-{i}": 10 + i for i in range(40)}
    mine = {a for a in waiting if owner(a, sharing) == "me"}
    assert 0 < len(mine) < len(waiting)
    desk = AdmissionDesk("me")

    due = desk.due(waiting, set(), sharing, now=100.0, overdue_after=15.0)
    assert {a for a, _ in due} == mine
    assert all(seq == waiting[a] for a, seq in due)
    assert {a for a, _ in desk.due(waiting, set(), sharing, 114.9, 15.0)} == mine
    # The peer has not started its own within the timeout: every one is due here.
    assert {a for a, _ in desk.due(waiting, set(), sharing, 115.0, 15.0)} == set(waiting)
    # Alone, the spawner owns them all.
    assert {a for a, _ in desk.due(waiting, set(), ["me"], 101.0, 15.0)} == set(waiting)


def test_a_spawner_does_not_try_again_what_it_decided_on_or_is_busy_with() -> None:
    desk = AdmissionDesk("me")
    waiting = {"a": 5, "b": 6, "c": 7}
    desk.decide("a", 5)
    assert desk.due(waiting, {"b"}, ["me"], 1.0, 15.0) == [("c", 7)]
    assert desk.undecided(waiting) == 2

    # A new admission of "a" (a resume) is not the one decided on.
    waiting["a"] = 9
    assert ("a", 9) in desk.due(waiting, {"b"}, ["me"], 2.0, 15.0)
    assert desk.decided == {}  # forgotten once it no longer waits


def test_an_admission_seen_when_folded_is_overdue_from_then() -> None:
    desk = AdmissionDesk("me")
    others = ["me", "zz"]
    agent = next(a for a in (f"x{i}" for i in range(100)) if owner(a, others) == "zz")
    desk.saw(agent, 4, now=50.0)
    assert desk.due({agent: 4}, set(), others, 64.0, 15.0) == []
    assert desk.due({agent: 4}, set(), others, 65.0, 15.0) == [(agent, 4)]


class Published:
    """A connection that keeps what is published (the spawner's heartbeats)."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    async def publish(self, subject: str, data: bytes) -> None:
        self.bodies.append(json.loads(data))


def lone_spawner(spawner_id: str) -> tuple[Spawner, Published]:
    spawner = Spawner.__new__(Spawner)  # only what heartbeats touch
    published = Published()
    spawner.log = SimpleNamespace(nc=published)  # type: ignore[assignment]
    spawner.spawner_id, spawner.heartbeat_interval = spawner_id, 2.0
    spawner.peers = PeerWatch(since=time.monotonic())
    spawner.beats = PeerWatch(since=time.monotonic())
    spawner.running, spawner.takes_admissions, spawner._out_of_turn = {}, True, set()
    return spawner, published


async def test_a_new_peer_is_answered_at_once_and_a_leaving_one_loses_its_share() -> None:
    spawner, published = lone_spawner("me")
    assert spawner.sharing(time.monotonic()) == ["me"]

    await spawner.heard({"spawner_id": "peer", "takes_admissions": True})
    await asyncio.sleep(0)  # the beat sent out of turn
    assert [b["spawner_id"] for b in published.bodies] == ["me"]
    assert sorted(spawner.sharing(time.monotonic())) == ["me", "peer"]

    await spawner.heard({"spawner_id": "peer", "takes_admissions": True})
    await asyncio.sleep(0)
    assert len(published.bodies) == 1  # a known peer is not answered again

    await spawner.heard({"spawner_id": "peer", "takes_admissions": False})
    assert spawner.sharing(time.monotonic()) == ["me"]
    assert "peer" in spawner.peers.heard  # its running agents are still watched

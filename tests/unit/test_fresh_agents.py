"""`FreshAgents` answers an admission of a spawn as reads of the log would: for any log, from
wherever the spawner's projection began folding it, whenever it answers at all."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grove_core.records import Recorded
from grove_events import ControlEvent, SpawnEvent, StatusEvent, TerminateEvent
from grove_spawner.domain import FreshAgents
from tests.unit.helpers import Log

pytestmark = pytest.mark.unit

AGENTS = ("a", "b", "c")

#: One step of a log: (what, which agent, a detail).
steps = st.lists(
    st.tuples(
        st.sampled_from(
            ["spawn", "admitted", "started", "completed", "stop", "resume", "terminate"]
        ),
        st.sampled_from(AGENTS),
        st.sampled_from(["enough", None]),
    ),
    max_size=30,
)


def build(plan: list[tuple[str, str, str | None]]) -> Log:
    """A log of the plan. An agent's events all come after its first spawn (its id is new);
    later spawns of it may come at any time, and change nothing."""
    log = Log()
    spawned: set[str] = set()
    for what, agent, detail in plan:
        if what == "spawn":
            log.spawn(agent, task=f"task {len(log.records)}")
            spawned.add(agent)
        elif agent not in spawned:
            continue
        elif what in ("admitted", "started", "completed"):
            log.status(agent, what)
        elif what == "stop":
            log.control(agent, "stop", reason=detail)
        elif what == "resume":
            log.control(agent, "resume")
        else:
            log.terminate(agent)
    return log


def read_from_log(records: list[Recorded], agent: str) -> dict[str, object]:
    """What the spawner's reads of the log give for the agent: its first spawn, the newest of
    the rest."""
    last_end = None
    spawn = None
    started = False
    stop: str | None = None
    for recorded in records:
        event = recorded.event
        if event.agent_id != agent:
            continue
        if isinstance(event, TerminateEvent):
            last_end = recorded.seq
        elif isinstance(event, SpawnEvent):
            spawn = spawn or event
        elif isinstance(event, StatusEvent) and event.status_type == "started":
            started = True
        elif isinstance(event, ControlEvent):
            stop = (event.reason or "stopped") if event.action == "stop" else None
    return {"last_end": last_end, "spawn": spawn, "started": started, "stop": stop}


@settings(max_examples=500, deadline=None)
@given(plan=steps, data=st.data())
def test_an_answer_is_what_the_log_says(
    plan: list[tuple[str, str, str | None]], data: st.DataObject
) -> None:
    records = build(plan).records
    begin = data.draw(st.integers(0, len(records)), label="projection began after")
    now = data.draw(st.integers(begin, len(records)), label="folded up to")
    fresh = FreshAgents()
    for recorded in records[begin:now]:  # the projection began after `begin` records
        fresh.fold(recorded)
    for agent in AGENTS:
        truth = read_from_log(records[:now], agent)
        spawn = truth["spawn"]
        if not isinstance(spawn, SpawnEvent):
            assert agent not in fresh.agents
            continue
        answer = fresh.get(agent, spawn.event_id)  # an admission of its first spawn
        if answer is None:
            continue  # the spawner reads the log
        assert truth["last_end"] is None
        assert answer.spawn is spawn
        assert answer.started == truth["started"]
        assert answer.stop == truth["stop"]


def test_an_agent_is_known_from_its_first_spawn_until_its_end() -> None:
    log = Log()
    fresh = FreshAgents()
    first = log.spawn("a").event
    again = log.spawn("a").event
    for recorded in log.records:
        fresh.fold(recorded)
    assert fresh.get("a", again.event_id) is None  # not the spawn the governor admits
    known = fresh.get("a", first.event_id)
    assert known is not None
    assert known.spawn is first
    assert not known.started
    assert known.stop is None
    fresh.fold(log.control("a", "stop", reason="enough"))
    assert known.stop == "enough"
    fresh.fold(log.control("a", "resume"))
    assert known.stop is None
    fresh.fold(log.status("a", "started"))
    assert known.started
    fresh.fold(log.terminate("a"))
    assert fresh.get("a", first.event_id) is None
    fresh.fold(log.spawn("a"))  # a spawn after the end: not the agent's first
    assert fresh.get("a", first.event_id) is None


def test_it_keeps_the_newest_agents_within_its_limit() -> None:
    log = Log()
    fresh = FreshAgents(limit=2)
    spawns = [log.spawn(agent).event for agent in ("a", "b", "c")]
    for recorded in log.records:
        fresh.fold(recorded)
    assert fresh.get("a", spawns[0].event_id) is None  # dropped: its admission reads the log
    assert fresh.get("b", spawns[1].event_id) is not None
    assert fresh.get("c", spawns[2].event_id) is not None

"""The event log's guarantees against a real nats-server: dedup and the expected-sequence race."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import json
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import nats.errors
import pytest
from nats.js import api as js_api
from prometheus_client import REGISTRY

from grove_core.log import (
    JS_API,
    Append,
    Appended,
    ConcurrencyConflict,
    EventLog,
    LogError,
)
from grove_core.projection import (
    CATCH_UP_GC_THRESHOLD,
    Mark,
    ProjectionRunner,
    ProjectionStore,
)
from grove_core.records import RawRecord, Recorded, decode_record
from grove_core.tasks import cancel_and_wait
from grove_core.tree import TreeState
from grove_core.tree import evolve as evolve_tree
from grove_events import (
    GROVE_STREAM,
    AgentConfig,
    Event,
    SpawnEvent,
    StatusEvent,
    new_id,
    subject_for,
)
from tests.conftest import NatsEndpoint

pytestmark = pytest.mark.integration


def spawn_event(agent_id: str) -> SpawnEvent:
    return SpawnEvent(
        event_id=new_id(),
        agent_id=agent_id,
        timestamp=datetime.now(UTC),
        task="say hello",
        config=AgentConfig(runtime="command", command=["echo", "hello"]),
    )


def status_event(agent_id: str, status_type: str = "admitted") -> StatusEvent:
    return StatusEvent(
        event_id=new_id(),
        agent_id=agent_id,
        timestamp=datetime.now(UTC),
        status_type=status_type,  # type: ignore[arg-type]
    )


def tree_runner(
    name: str, event_log: EventLog, store: ProjectionStore, **options: Any
) -> ProjectionRunner[TreeState]:
    """A runner of the agent tree's projection (`options`: the runner's own)."""
    return ProjectionRunner(
        name=name, log=event_log, store=store, state_type=TreeState, evolve=evolve_tree, **options
    )


async def fold_until_caught_up(runner: ProjectionRunner[Any], timeout: float = 10.0) -> None:
    """Run `runner` until it has folded the log as it was when it started, then stop it."""
    running = asyncio.create_task(runner.run())
    try:
        await asyncio.wait_for(runner.caught_up.wait(), timeout)
    finally:
        await cancel_and_wait(running)


async def stored(event_log: EventLog, subjects: str = "grove.>") -> list[Recorded]:
    """Every valid event in the log, by a replay to the current tip."""
    out = []
    async with asyncio.timeout(5):
        async for item in event_log.events(1, subjects=subjects):
            assert isinstance(item, Recorded), item
            out.append(item)
    return out


async def test_a_retried_append_is_stored_once(event_log: EventLog) -> None:
    event = spawn_event(new_id())

    async with asyncio.timeout(10):
        first = await event_log.append(event)
        second = await event_log.append(event)

    assert first == Appended(seq=first.seq, duplicate=False)
    assert second.duplicate is True
    assert second.seq == first.seq
    info = await event_log.js.stream_info(event_log.stream)
    assert info.state.messages == 1
    events = await stored(event_log)
    assert [r.event.event_id for r in events] == [event.event_id]


async def test_a_retry_of_a_pipelined_batch_is_stored_once(event_log: EventLog) -> None:
    events = [spawn_event(new_id()) for _ in range(20)]

    async with asyncio.timeout(10):
        first = await event_log.append_many(events)
        again = await event_log.append_many(events)

    assert not any(a.duplicate for a in first)
    assert all(a.duplicate for a in again)
    assert [a.seq for a in again] == [a.seq for a in first]
    assert await event_log.last_seq() == 20
    assert [r.event.event_id for r in await stored(event_log)] == [e.event_id for e in events]


@pytest.mark.parametrize("contenders", [2, 16])
async def test_concurrent_guarded_appends_have_exactly_one_winner(
    event_log: EventLog, contenders: int
) -> None:
    agent_id = new_id()
    await event_log.append(spawn_event(agent_id))
    expected = 0  # no status for this agent yet
    attempts = [status_event(agent_id) for _ in range(contenders)]

    async def attempt(event: StatusEvent) -> Appended | ConcurrencyConflict:
        try:
            return await event_log.append(
                event,
                expect_last_seq=expected,
                expect_subject=subject_for("status", agent_id),
            )
        except ConcurrencyConflict as conflict:
            return conflict

    async with asyncio.timeout(10):
        outcomes = await asyncio.gather(*(attempt(e) for e in attempts))

    wins = [o for o in outcomes if isinstance(o, Appended)]
    conflicts = [o for o in outcomes if isinstance(o, ConcurrencyConflict)]
    assert len(wins) == 1, outcomes
    assert len(conflicts) == contenders - 1
    assert not wins[0].duplicate
    statuses = await stored(event_log, subject_for("status", agent_id))
    assert len(statuses) == 1
    assert statuses[0].seq == wins[0].seq


async def test_a_guard_on_the_agent_wildcard_sees_writes_on_other_subjects(
    event_log: EventLog,
) -> None:
    agent_id = new_id()
    spawned = await event_log.append(spawn_event(agent_id))
    status = await event_log.append(status_event(agent_id))
    assert status.seq > spawned.seq

    async with asyncio.timeout(10):
        with pytest.raises(ConcurrencyConflict):
            await event_log.append(
                status_event(agent_id, "started"),
                expect_last_seq=spawned.seq,
                expect_subject=f"grove.*.{agent_id}",
            )
        won = await event_log.append(
            status_event(agent_id, "started"),
            expect_last_seq=status.seq,
            expect_subject=f"grove.*.{agent_id}",
        )

    assert won.seq == status.seq + 1
    assert len(await stored(event_log, f"grove.*.{agent_id}")) == 3


async def test_a_filtered_replay_stops_at_the_tip(event_log: EventLog) -> None:
    spawned = spawn_event(new_id())
    await event_log.append(spawned)
    await event_log.append(status_event(new_id()))  # the newest message is not a spawn

    assert [r.event.event_id for r in await stored(event_log, "grove.spawn.*")] == [
        spawned.event_id
    ]
    assert await stored(event_log, "grove.terminate.*") == []


async def test_an_event_without_a_timestamp_gets_the_stream_s_whatever_the_read(
    event_log: EventLog,
) -> None:
    # A producer that sends no timestamp: the event's time is the stream's own time of the
    # message, to the millisecond, the same from a replay and from a direct lookup, every time.
    agent = new_id()
    body = json.dumps(
        {
            "event_id": new_id(),
            "type": "spawn",
            "agent_id": agent,
            "task": "t",
            "config": {"runtime": "command", "command": ["true"]},
        }
    )
    ack = await event_log.js.publish(subject_for("spawn", agent), body.encode())
    stored = await event_log.js.get_msg(event_log.stream, seq=ack.seq)
    assert stored.time is not None
    replayed = [r async for r in event_log.read(ack.seq, until_seq=ack.seq)]
    looked_up = await event_log.get_last(subject_for("spawn", agent))
    assert looked_up is not None
    times = {decode_record(r).event.timestamp for r in [*replayed, looked_up, *replayed]}
    assert len(times) == 1
    (timestamp,) = times
    assert timestamp is not None
    assert timestamp.microsecond % 1000 == 0
    assert abs((timestamp - stored.time).total_seconds()) < 0.001


async def test_more_than_a_thousand_readers_at_once(event_log: EventLog) -> None:
    # nats-server 2.15 gives a stream 1,000 consumers unless it names its own limit; a busy
    # tree holds one ordered consumer per wait for a child's end.
    info = await event_log.js.stream_info(event_log.stream)
    assert info.config.max_consumers == GROVE_STREAM.max_consumers
    agent = new_id()
    followers = [event_log.read(1, subjects=f"grove.*.{agent}", follow=True) for _ in range(1100)]
    firsts = [asyncio.ensure_future(anext(f)) for f in followers]
    try:
        await asyncio.sleep(0)
        await event_log.append(spawn_event(agent))
        async with asyncio.timeout(60):
            seen = await asyncio.gather(*firsts)
        assert {record.subject for record in seen} == {f"grove.spawn.{agent}"}
    finally:
        for first in firsts:
            first.cancel()
        for follower in followers:
            await follower.aclose()


async def test_set_up_gives_an_existing_stream_the_consumer_limit(event_log: EventLog) -> None:
    info = await event_log.js.stream_info(event_log.stream)
    await event_log.js.update_stream(dataclasses.replace(info.config, max_consumers=1000))
    await event_log.ensure_stream()
    info = await event_log.js.stream_info(event_log.stream)
    assert info.config.max_consumers == GROVE_STREAM.max_consumers


async def test_set_up_asks_again_while_jetstream_does_not_answer(
    event_log: EventLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A fresh cluster can take longer than a request's timeout to form a new stream's group.
    await event_log.js.delete_stream(event_log.stream)
    add_stream = event_log.js.add_stream
    unanswered = 2

    async def slow_add_stream(config: js_api.StreamConfig) -> js_api.StreamInfo:
        nonlocal unanswered
        info = await add_stream(config)  # stored, but its answer lost the first times
        if unanswered:
            unanswered -= 1
            raise nats.errors.TimeoutError
        return info

    monkeypatch.setattr(event_log.js, "add_stream", slow_add_stream)
    info = await event_log.ensure_stream()
    assert unanswered == 0
    assert info.config.name == event_log.stream
    assert (await event_log.js.stream_info(event_log.stream)).config.allow_atomic


async def as_replicated(event_log: EventLog, monkeypatch: pytest.MonkeyPatch) -> EventLog:
    """Another `EventLog` on the same connection, to which the stream says it has three
    replicas (as on a cluster): its lookups go to the stream's leader."""
    info = await event_log.js.stream_info(event_log.stream)
    three = dataclasses.replace(info, config=dataclasses.replace(info.config, num_replicas=3))

    async def replicated_info(name: str) -> js_api.StreamInfo:
        return three

    monkeypatch.setattr(event_log.js, "stream_info", replicated_info)
    return EventLog(event_log.nc, event_log.js)


async def test_lookups_are_direct_only_on_a_single_replica_stream(
    event_log: EventLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Any replica answers a direct get, and a follower may lag: on a replicated stream the
    # leader answers lookups (a spawner must find the spawn of an agent it was told to start).
    agent = new_id()
    await event_log.append(spawn_event(agent))
    first = await event_log.append(status_event(agent, "admitted"))
    await event_log.append(status_event(agent, "started"))
    assert await event_log._direct()

    replicated = await as_replicated(event_log, monkeypatch)
    assert not await replicated._direct()

    def lookups(log: EventLog) -> list[Awaitable[RawRecord | None]]:
        status = subject_for("status", agent)
        return [
            log.get_last(subject_for("spawn", agent)),
            log.get_last(status),
            log.get_next(status, 1),
            log.get_next(status, first.seq + 1),
            log.get_last(subject_for("terminate", agent)),  # none
            log.get_next(status, first.seq + 10),  # none after
            log.get_at(first.seq),
            log.get_at(first.seq + 10),  # none there
        ]

    direct = await asyncio.gather(*lookups(event_log))
    from_leader = await asyncio.gather(*lookups(replicated))
    assert [r is None for r in direct] == [False, False, False, False, True, True, False, True]
    assert [(r.seq, r.subject, r.data, r.timestamp) for r in direct if r is not None] == [
        (r.seq, r.subject, r.data, r.timestamp) for r in from_leader if r is not None
    ]
    assert [r is None for r in from_leader] == [r is None for r in direct]


class Unanswered:
    """Passes calls through, but the next `count` of them (of those `asked` accepts) time out
    first, as when a server restarts or a cluster elects a stream's leader."""

    def __init__(self) -> None:
        self.count = 0

    def around(
        self,
        call: Callable[..., Awaitable[Any]],
        asked: Callable[..., bool] = lambda *args, **kwargs: True,
    ) -> Callable[..., Awaitable[Any]]:
        async def answer_later(*args: Any, **kwargs: Any) -> Any:
            if self.count and asked(*args, **kwargs):
                self.count -= 1
                raise nats.errors.TimeoutError
            return await call(*args, **kwargs)

        return answer_later


async def test_the_newest_sequence_is_asked_again_while_a_leader_is_elected(
    event_log: EventLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A cluster failing over does not answer JetStream requests for a few seconds; a caller
    # asking for the newest sequence then (a client waiting for the router) gets it later.
    agent = new_id()
    appended = await event_log.append(spawn_event(agent))
    unanswered = Unanswered()
    monkeypatch.setattr(event_log.js, "stream_info", unanswered.around(event_log.js.stream_info))

    unanswered.count = 4
    assert await event_log.last_seq() == appended.seq
    unanswered.count = 2
    name, last = await event_log.identity()
    assert (name.split()[0], last) == (event_log.stream, appended.seq)
    assert unanswered.count == 0


async def test_lookups_on_a_replicated_stream_are_asked_again_while_a_leader_is_elected(
    event_log: EventLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    replicated = await as_replicated(event_log, monkeypatch)
    unanswered = Unanswered()
    monkeypatch.setattr(event_log.js, "get_last_msg", unanswered.around(event_log.js.get_last_msg))
    monkeypatch.setattr(event_log.js, "get_msg", unanswered.around(event_log.js.get_msg))
    await lookups_asked_again(replicated, unanswered)


async def test_direct_lookups_are_asked_again_while_the_server_does_not_answer(
    event_log: EventLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On one server, a lookup is a direct get: a server restarting does not answer it.
    assert await event_log._direct()
    unanswered = Unanswered()

    def direct_get(subject: str, *args: Any, **kwargs: Any) -> bool:
        return f"{subject}.".startswith(f"{JS_API}.DIRECT.GET.")

    monkeypatch.setattr(
        event_log.nc, "request", unanswered.around(event_log.nc.request, direct_get)
    )
    await lookups_asked_again(event_log, unanswered)


async def lookups_asked_again(log: EventLog, unanswered: Unanswered) -> None:
    """Each kind of lookup, found (or not) after the first tries went unanswered."""
    agent = new_id()
    spawn_seq = (await log.append(spawn_event(agent))).seq
    admitted_seq = (await log.append(status_event(agent, "admitted"))).seq
    unanswered.count = 2
    last = await log.get_last(subject_for("spawn", agent))
    assert (unanswered.count, last and last.seq) == (0, spawn_seq)
    unanswered.count = 2
    following = await log.get_next(subject_for("status", agent), 1)
    assert (unanswered.count, following and following.seq) == (0, admitted_seq)
    unanswered.count = 2
    at = await log.get_at(admitted_seq)
    assert (unanswered.count, at and at.subject) == (0, subject_for("status", agent))
    unanswered.count = 1
    assert await log.get_last(subject_for("terminate", agent)) is None
    assert unanswered.count == 0


async def append_after_restart(event_log: EventLog, event: Event, within: float = 20.0) -> Appended:
    """Append `event` once the restarted server takes it, retrying the same event (an append
    whose acknowledgement was lost in the restart is stored once)."""
    deadline = asyncio.get_running_loop().time() + within
    while True:
        with contextlib.suppress(LogError, nats.errors.Error):
            return await event_log.append(event)
        assert asyncio.get_running_loop().time() < deadline, "no append after the restart"
        await asyncio.sleep(0.2)


async def test_a_projection_counts_the_events_it_folded_by_its_write(
    event_log: EventLog, tmp_path: Path
) -> None:
    agent = f"counted-{new_id()}"
    await event_log.append(spawn_event(agent))
    for status_type in ("admitted", "started", "completed"):
        await event_log.append(status_event(agent, status_type))
    name = f"counted-{new_id()}"
    store = ProjectionStore(f"sqlite:///{tmp_path / 'p.db'}")
    runner = tree_runner(name, event_log, store)
    running = asyncio.create_task(runner.run())
    try:
        await asyncio.wait_for(runner.caught_up.wait(), 10)  # caught up: written
        folded = REGISTRY.get_sample_value("grove_events_applied_total", {"projection": name})
        assert runner.applied_seq == await event_log.last_seq()
        assert folded == len(await stored(event_log))  # every valid event, none twice
    finally:
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running
        store.close()


async def test_a_projection_takes_the_events_appended_on_its_own_connection_undecoded(
    event_log: EventLog, nats_server: NatsEndpoint, tmp_path: Path
) -> None:
    agent = f"own-{new_id()}"
    folded: list[Recorded] = []

    def evolve(state: TreeState, recorded: Recorded) -> TreeState:
        if recorded.event.agent_id == agent:
            folded.append(recorded)
        return evolve_tree(state, recorded)

    spawn = spawn_event(agent)
    await event_log.append(spawn)  # no reader yet: nothing kept
    assert len(event_log.own) == 0
    store = ProjectionStore(f"sqlite:///{tmp_path / 'p.db'}")
    runner = ProjectionRunner(
        name=f"own-{new_id()}", log=event_log, store=store, state_type=TreeState, evolve=evolve
    )
    running = asyncio.create_task(runner.run())
    await asyncio.wait_for(runner.caught_up.wait(), 10)
    admitted = status_event(agent, "admitted")
    started = status_event(agent, "started")
    [after] = await event_log.append_many([admitted])
    [appended] = await event_log.append_batch([Append(started, expect_last_seq=after.seq)])
    assert isinstance(appended, Appended)
    other = await EventLog.connect(nats_server.url, name="another")
    try:
        completed = status_event(agent, "completed")
        await other.append(completed)
    finally:
        await other.close()

    try:
        assert await runner.reached(await event_log.last_seq(), 10)
    finally:
        await cancel_and_wait(running)
        store.close()
    by_log = {item.seq: item for item in await stored(event_log) if item.event.agent_id == agent}
    assert folded == [by_log[item.seq] for item in folded]  # the same records as decoding gives
    assert [item.event.event_id for item in folded] == [
        event.event_id for event in (spawn, admitted, started, completed)
    ]
    # Kept here: the very objects; appended before the runner ran, or on another connection:
    # decoded from the log.
    assert [
        item.event is event
        for item, event in zip(folded, (spawn, admitted, started, completed), strict=True)
    ] == [False, True, True, False]
    assert len(event_log.own) == 0  # each taken once


class RefusingFirstWrites(ProjectionStore):
    """A store that refuses its first writes, as a locked database would."""

    refusals = 2

    def save(self, projection: str, seq: int, changed: Any, mark: Mark | None = None) -> None:
        if self.refusals:
            self.refusals -= 1
            raise OSError("database is locked")
        super().save(projection, seq, changed, mark)


async def test_a_catch_up_whose_writes_are_refused_retries_and_loses_nothing(
    event_log: EventLog, tmp_path: Path
) -> None:
    agents = [f"refused-{index}-{new_id()}" for index in range(600)]
    await event_log.append_many(spawn_event(agent) for agent in agents)
    store = RefusingFirstWrites(f"sqlite:///{tmp_path / 'p.db'}")
    runner = tree_runner(
        "refused",
        event_log,
        store,
        catch_up_batch_size=100,  # the catch-up writes its own batches, the first one refused
        flush_interval=0.05,
    )
    running = asyncio.create_task(runner.run())
    try:
        await asyncio.wait_for(runner.caught_up.wait(), 20)
        for _ in range(3):  # the refusals may outlast the catch-up
            if await runner.write():
                break
    finally:
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running
    seq, rows = store.load("refused")
    store.close()
    assert store.refusals == 0
    assert seq == await event_log.last_seq()
    assert set(TreeState.from_rows(rows).agents) == set(agents)


class CountingStore(ProjectionStore):
    """A store that notes the checkpoint of each write."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.saved: list[int] = []

    def save(self, projection: str, seq: int, changed: Any, mark: Mark | None = None) -> None:
        super().save(projection, seq, changed, mark)
        self.saved.append(seq)


async def test_a_catch_up_writes_larger_batches_than_a_projection_that_follows_the_log(
    event_log: EventLog, tmp_path: Path
) -> None:
    base = await event_log.last_seq()
    await event_log.append_many(spawn_event(f"early-{index}-{new_id()}") for index in range(500))
    last_folded = asyncio.Event()

    async def note(recorded: Recorded, _live: bool) -> None:
        if recorded.seq == base + 620:
            last_folded.set()  # the writes it follows are done

    store = CountingStore(f"sqlite:///{tmp_path / 'p.db'}")
    runner = tree_runner(
        "batches",
        event_log,
        store,
        after_event=note,
        batch_size=50,
        catch_up_batch_size=200,
        flush_interval=60,  # no timed writes: only the batches write
    )
    running = asyncio.create_task(runner.run())
    try:
        await asyncio.wait_for(runner.caught_up.wait(), 20)
        assert store.saved == [base + 200, base + 400, base + 500]  # the last on catching up
        await event_log.append_many(spawn_event(f"late-{index}-{new_id()}") for index in range(120))
        await asyncio.wait_for(last_folded.wait(), 20)
        assert store.saved[3:] == [base + 550, base + 600]
    finally:
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running
        store.close()


async def test_the_collector_runs_less_often_only_while_a_projection_catches_up(
    event_log: EventLog, tmp_path: Path
) -> None:
    await event_log.append_many(spawn_event(f"gc-{index}-{new_id()}") for index in range(50))
    usual = gc.get_threshold()
    seen: dict[bool, set[int]] = {False: set(), True: set()}
    folded_live = asyncio.Event()

    async def note(_: Recorded, live: bool) -> None:
        seen[live].add(gc.get_threshold()[0])
        if live:
            folded_live.set()

    store = ProjectionStore(f"sqlite:///{tmp_path / 'p.db'}")
    runners = [
        tree_runner(f"gc-{index}", event_log, store, after_event=note)
        for index in range(2)  # two at once: the threshold comes back once both caught up
    ]
    running = [asyncio.create_task(runner.run()) for runner in runners]
    try:
        for runner in runners:
            await asyncio.wait_for(runner.caught_up.wait(), 10)
        assert gc.get_threshold() == usual
        await event_log.append(spawn_event(f"gc-live-{new_id()}"))
        await asyncio.wait_for(folded_live.wait(), 10)
    finally:
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        store.close()
    assert seen[False] == {max(usual[0], CATCH_UP_GC_THRESHOLD)}
    assert seen[True] == {usual[0]}
    assert gc.get_threshold() == usual


async def test_a_projection_tells_waiters_when_it_has_folded_the_log_that_far(
    event_log: EventLog, tmp_path: Path
) -> None:
    agent = f"reached-{new_id()}"
    spawned = await event_log.append(spawn_event(agent))
    store = ProjectionStore(f"sqlite:///{tmp_path / 'p.db'}")
    runner = tree_runner(f"reached-{new_id()}", event_log, store)
    running = asyncio.create_task(runner.run())
    try:
        assert await runner.reached(spawned.seq, 10)
        later = spawned.seq + 2
        assert not await runner.reached(later, 0.2)  # nothing that far yet: it says so in time
        # Two waiters for positions the log has not reached; each is told when it is folded.
        waiting = [asyncio.create_task(runner.reached(seq, 10)) for seq in (later, later - 1)]
        await asyncio.sleep(0.05)
        assert not any(task.done() for task in waiting)
        await event_log.append(status_event(agent, "admitted"))
        assert await waiting[1]
        assert not waiting[0].done()
        await event_log.append(status_event(agent, "started"))
        assert await waiting[0]
        assert runner.applied_seq >= later
    finally:
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running
        store.close()

"""A projection that follows only its kinds once caught up (`follow_kinds_only`), against a real
nats-server: what the server sends it, and how `reached` answers for positions of other kinds."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats.errors
import pytest
from nats.js import api as js_api

from grove_core import projection
from grove_core.log import EventLog
from grove_core.projection import ProjectionRunner, ProjectionStore
from grove_core.tasks import cancel_and_wait
from grove_core.tree import TreeState
from grove_events import new_id
from tests.integration.test_log import spawn_event, status_event, tree_runner

pytestmark = pytest.mark.integration

SPAWNS = frozenset({"spawn"})


def spawns_runner(event_log: EventLog, tmp_path: Path) -> ProjectionRunner[TreeState]:
    """A tree projection of spawns only, following only spawns once caught up."""
    store = ProjectionStore(f"sqlite:///{tmp_path / f'{new_id()}.db'}")
    return tree_runner(f"spawns-{new_id()}", event_log, store, kinds=SPAWNS, follow_kinds_only=True)


@contextlib.asynccontextmanager
async def running_spawns(
    event_log: EventLog, tmp_path: Path
) -> AsyncIterator[ProjectionRunner[TreeState]]:
    """`spawns_runner`, running until the block ends (then it folds nothing more)."""
    runner = spawns_runner(event_log, tmp_path)
    running = asyncio.create_task(runner.run())
    try:
        yield runner
    finally:
        await cancel_and_wait(running)
        runner.store.close()


@pytest.fixture
async def following(
    event_log: EventLog, tmp_path: Path
) -> AsyncIterator[ProjectionRunner[TreeState]]:
    """`spawns_runner`, running for the test."""
    async with running_spawns(event_log, tmp_path) as runner:
        yield runner


async def consumers_filtered_on(event_log: EventLog, subject: str) -> list[js_api.ConsumerInfo]:
    return [
        info
        for info in await event_log.js.consumers_info(event_log.stream)
        if info.config.filter_subject == subject
    ]


async def test_once_caught_up_the_server_sends_only_the_projection_s_kinds(
    event_log: EventLog, tmp_path: Path
) -> None:
    first, second, third = (f"kinds-{index}-{new_id()}" for index in range(3))
    for agent in (first, second):  # read during the catch-up, every message
        await event_log.append(spawn_event(agent))
        await event_log.append(status_event(agent, "admitted"))
    async with running_spawns(event_log, tmp_path) as runner:
        await asyncio.wait_for(runner.caught_up.wait(), 10)
        assert runner.applied_seq == 4
        await event_log.append(status_event(first, "started"))
        spawned = await event_log.append(spawn_event(third))
        for status_type in ("admitted", "started"):
            await event_log.append(status_event(third, status_type))
        assert await runner.reached(await event_log.last_seq(), 10)

        assert set(runner.state.agents) == {first, second, third}
        # The statuses after the last spawn never came: the fold stands at the spawn.
        assert runner.applied_seq == spawned.seq
        [consumer] = await consumers_filtered_on(event_log, "grove.spawn.*")
        # Of the four messages appended since it was made, the server delivered the one spawn.
        assert consumer.delivered.consumer_seq == 1


async def test_reached_answers_for_positions_of_other_kinds_from_the_log(
    event_log: EventLog, following: ProjectionRunner[TreeState]
) -> None:
    agent = f"reached-{new_id()}"
    await event_log.append(spawn_event(agent))
    await asyncio.wait_for(following.caught_up.wait(), 10)
    admitted = await event_log.append(status_event(agent, "admitted"))
    # Only a status after the fold's last spawn: folded that far already.
    assert await following.reached(admitted.seq, 5)
    # Further than the log: not yet, and said so in time.
    assert not await following.reached(admitted.seq + 2, 0.2)

    # A waiter for a position beyond a spawn is told once that spawn is folded, and a waiter
    # for a position the log has not reached once the log gets there.
    later = admitted.seq + 2
    waiters = [asyncio.create_task(following.reached(seq, 10)) for seq in (later, later + 1)]
    await asyncio.sleep(0.1)
    assert not any(waiter.done() for waiter in waiters)
    await event_log.append(status_event(agent, "started"))
    child = f"child-{new_id()}"
    spawned = await event_log.append(spawn_event(child))
    assert spawned.seq == later
    assert await waiters[0]
    assert child in following.state.agents
    assert not waiters[1].done()
    await event_log.append(status_event(child, "admitted"))
    assert await waiters[1]
    assert following.applied_seq == later


async def test_a_position_before_an_event_of_its_kinds_needs_no_fold_of_that_event(
    event_log: EventLog, tmp_path: Path
) -> None:
    async with running_spawns(event_log, tmp_path) as runner:
        await asyncio.wait_for(runner.caught_up.wait(), 10)  # following spawns only
        first = await event_log.append(spawn_event(f"first-{new_id()}"))
        assert await runner.reached(first.seq, 10)
    # Stopped: it folds nothing more.
    admitted = await event_log.append(status_event(f"other-{new_id()}", "admitted"))
    second = await event_log.append(spawn_event(f"second-{new_id()}"))
    # Only a status between what was folded and the position: reached, though the spawn
    # after it was not folded.
    assert await runner.reached(admitted.seq, 5)
    assert not await runner.reached(second.seq, 0.2)
    assert runner.applied_seq == first.seq


async def test_a_waiter_from_the_catch_up_is_answered_after_it(
    event_log: EventLog, tmp_path: Path
) -> None:
    agent = f"early-{new_id()}"
    await event_log.append(spawn_event(agent))
    admitted = await event_log.append(status_event(agent, "admitted"))
    runner = spawns_runner(event_log, tmp_path)
    # Asked before the runner reads anything: the catch-up folds every message, and a
    # position past its end is answered from the log after it.
    waiter = asyncio.create_task(runner.reached(admitted.seq + 1, 10))
    running = asyncio.create_task(runner.run())
    try:
        await asyncio.wait_for(runner.caught_up.wait(), 10)
        assert not waiter.done()
        await event_log.append(status_event(agent, "started"))
        assert await waiter
    finally:
        await cancel_and_wait(running)
        runner.store.close()


async def test_a_filtered_consumer_the_server_refuses_at_first_is_made_again(
    event_log: EventLog, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The server goes away just as the runner, caught up, makes its filtered consumer.
    refused: list[int] = []
    real_read = event_log.read

    def read(from_seq: int = 1, **options: Any) -> AsyncIterator[Any]:
        if isinstance(options.get("subjects"), list) and not refused:
            refused.append(from_seq)
            return no_server()
        return real_read(from_seq, **options)

    async def no_server() -> AsyncIterator[Any]:
        raise nats.errors.TimeoutError
        yield  # an async generator, as `EventLog.read` is

    monkeypatch.setattr(event_log, "read", read)
    monkeypatch.setattr(projection, "FOLLOW_RETRY_S", 0.01)
    async with running_spawns(event_log, tmp_path) as runner:
        await asyncio.wait_for(runner.caught_up.wait(), 10)
        agent = f"later-{new_id()}"
        spawned = await event_log.append(spawn_event(agent))
        assert await runner.reached(spawned.seq, 10)
        assert agent in runner.state.agents
        assert refused == [1]


def test_following_only_its_kinds_needs_kinds(event_log: EventLog, tmp_path: Path) -> None:
    store = ProjectionStore(f"sqlite:///{tmp_path / 'p.db'}")
    try:
        with pytest.raises(ValueError, match="needs the kinds"):
            tree_runner("no-kinds", event_log, store, follow_kinds_only=True)
    finally:
        store.close()

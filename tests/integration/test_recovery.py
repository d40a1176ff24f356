"""Crashes and bad input: nothing is lost or duplicated, and projections rebuild the same.

Services are killed with SIGKILL in the middle of work and restarted, databases are deleted,
and malformed messages are published on event subjects; the log must tell the same story.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
from collections import Counter
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agentgrove.client import GroveClient, build_config
from agentgrove.stack import Stack
from grove_core.log import EventLog
from grove_core.projection import ProjectionStore
from grove_core.records import Recorded
from grove_events import AgentConfig, SpawnEvent, StatusEvent, TerminateEvent, new_id

pytestmark = pytest.mark.integration

StackFactory = Callable[..., Stack]

ROOMY = """
resources:
  global:
    max_concurrent_agents: 1000
"""


async def history(event_log: EventLog) -> list[Recorded]:
    """Every valid event, by a replay to the current tip."""
    async with asyncio.timeout(30):
        return [item async for item in event_log.events(1) if isinstance(item, Recorded)]


def count_statuses(records: Iterable[Recorded], status_type: str) -> Counter[str]:
    return Counter(
        r.event.agent_id
        for r in records
        if isinstance(r.event, StatusEvent) and r.event.status_type == status_type
    )


def count_terminates(records: Iterable[Recorded]) -> Counter[str]:
    return Counter(r.event.agent_id for r in records if isinstance(r.event, TerminateEvent))


async def wait_ended(
    event_log: EventLog, agent_ids: Iterable[str], timeout: float
) -> dict[str, TerminateEvent]:
    """The terminate event of each agent, waiting for those not there yet."""
    wanted = set(agent_ids)
    ended: dict[str, TerminateEvent] = {}
    async with asyncio.timeout(timeout):
        async for item in event_log.events(1, subjects="grove.terminate.*", follow=True):
            if isinstance(item, Recorded) and item.event.agent_id in wanted:
                assert isinstance(item.event, TerminateEvent)
                ended.setdefault(item.event.agent_id, item.event)
                if len(ended) == len(wanted):
                    break
    return ended


async def wait_status(
    event_log: EventLog, status_type: str, agent_ids: Iterable[str], timeout: float
) -> None:
    """Wait until each agent has a status of this type."""
    waiting = set(agent_ids)
    async with asyncio.timeout(timeout):
        async for item in event_log.events(1, subjects="grove.status.*", follow=True):
            if (
                isinstance(item, Recorded)
                and isinstance(item.event, StatusEvent)
                and item.event.status_type == status_type
            ):
                waiting.discard(item.event.agent_id)
                if not waiting:
                    return


def python_agent(entrypoint: str) -> AgentConfig:
    return build_config("python", entrypoint=f"tests.agents:{entrypoint}")


def spawn_events(count: int, entrypoint: str = "quick") -> list[SpawnEvent]:
    return [
        SpawnEvent(
            event_id=new_id(),
            agent_id=new_id(),
            timestamp=datetime.now(UTC),
            task="go",
            config=python_agent(entrypoint),
        )
        for _ in range(count)
    ]


# -- SIGKILL and restart -----------------------------------------------------------------------


async def test_a_governor_killed_during_a_burst_loses_and_duplicates_nothing(
    make_stack: StackFactory, event_log: EventLog
) -> None:
    stack = await asyncio.to_thread(make_stack, config=ROOMY)
    governor = stack.services["governor"]
    batches = [spawn_events(10) for _ in range(10)]
    agents = [e.agent_id for batch in batches for e in batch]

    await event_log.append_many(batches[0])
    await wait_status(event_log, "admitted", [batches[0][0].agent_id], timeout=20)
    for batch in batches[1:4]:
        await event_log.append_many(batch)
    await asyncio.to_thread(governor.kill)
    for batch in batches[4:]:
        await event_log.append_many(batch)
    await asyncio.to_thread(stack.restart, "governor")

    ended = await wait_ended(event_log, agents, timeout=60)

    assert Counter(e.reason for e in ended.values()) == Counter(completed=100)
    await asyncio.sleep(0.5)
    records = await history(event_log)
    assert count_terminates(records) == Counter(dict.fromkeys(agents, 1))
    assert count_statuses(records, "admitted") == Counter(dict.fromkeys(agents, 1))
    assert count_statuses(records, "started") == Counter(dict.fromkeys(agents, 1))
    assert not count_statuses(records, "rejected")


async def test_a_spawner_killed_while_its_agent_runs_reports_the_agent_lost(
    make_stack: StackFactory, event_log: EventLog
) -> None:
    stack = await asyncio.to_thread(make_stack)
    client = GroveClient(event_log)
    agent = await client.spawn("30", python_agent("sleeper"))
    await wait_status(event_log, "started", [agent], timeout=20)

    await asyncio.to_thread(stack.services["spawner-1"].kill)
    await asyncio.to_thread(stack.restart, "spawner-1")

    ended = await wait_ended(event_log, [agent], timeout=20)
    assert ended[agent].reason == "failed"
    assert ended[agent].error is not None
    assert "spawner-1" in ended[agent].error

    after = await client.spawn("go", python_agent("quick"))
    assert (await wait_ended(event_log, [after], timeout=20))[after].reason == "completed"
    records = await history(event_log)
    assert count_statuses(records, "started") == Counter({agent: 1, after: 1})
    assert count_statuses(records, "admitted") == Counter({agent: 1, after: 1})
    assert count_terminates(records) == Counter({agent: 1, after: 1})


async def test_a_spawner_told_to_stop_ends_its_agents_as_stopped_and_exits(
    make_stack: StackFactory, event_log: EventLog
) -> None:
    stack = await asyncio.to_thread(make_stack)
    spawner = stack.services["spawner-1"]
    client = GroveClient(event_log)
    agents = [await client.spawn("30", python_agent("sleeper")) for _ in range(2)]
    await wait_status(event_log, "started", agents, timeout=20)
    await asyncio.sleep(4)  # a spawner that has been polling for work a while

    assert spawner.process is not None
    spawner.signal(signal.SIGTERM)
    try:
        code = await asyncio.to_thread(spawner.process.wait, 10)
    except subprocess.TimeoutExpired:
        await asyncio.to_thread(spawner.kill)
        pytest.fail("the spawner was still running 10 s after SIGTERM")

    assert code == 0
    ended = await wait_ended(event_log, agents, timeout=10)
    assert {e.reason for e in ended.values()} == {"stopped"}


# -- rebuilding a projection from the log ---------------------------------------------------------

REBUILT = ("governor", "router", "artifacts")

CAPACITY_SIX = """
resources:
  global:
    max_concurrent_agents: 6
"""


def projection_of(data_dir: Path, name: str) -> tuple[int, dict[str, dict[str, Any]]]:
    store = ProjectionStore(f"sqlite:///{data_dir / f'{name}.db'}")
    try:
        return store.load(name)
    finally:
        store.close()


def delete_database(data_dir: Path, name: str) -> None:
    for suffix in ("", "-wal", "-shm"):
        (data_dir / f"{name}.db{suffix}").unlink(missing_ok=True)


def stop_and_read(stack: Stack) -> dict[str, tuple[int, dict[str, dict[str, Any]]]]:
    for name in REBUILT:
        stack.services[name].stop()
    return {name: projection_of(stack.data_dir, name) for name in REBUILT}


async def test_a_deleted_database_is_rebuilt_to_the_same_projection(
    make_stack: StackFactory, event_log: EventLog
) -> None:
    stack = await asyncio.to_thread(make_stack, config=CAPACITY_SIX)
    client = GroveClient(event_log)
    parent = await client.spawn("3", python_agent("spawns_children"))
    first_sleeper = await client.spawn("30", python_agent("sleeper"))
    second_sleeper = await client.spawn("30", python_agent("sleeper"))
    ended = await wait_ended(event_log, [parent], timeout=30)
    assert ended[parent].result.summary == "completed,completed,completed"
    await wait_status(event_log, "started", [first_sleeper, second_sleeper], timeout=20)
    await asyncio.sleep(0.5)  # rows written while other agents are still live
    await client.stop(first_sleeper)
    await wait_ended(event_log, [first_sleeper], timeout=20)
    # Five places are free now; the sixth of the crowd finds the system at capacity.
    crowd = [await client.spawn("30", python_agent("sleeper")) for _ in range(6)]
    ended = await wait_ended(event_log, [crowd[-1]], timeout=20)
    assert ended[crowd[-1]].reason == "rejected"
    await wait_status(event_log, "started", crowd[:-1], timeout=20)
    await asyncio.sleep(0.5)
    tip = await event_log.last_seq()

    before = await asyncio.to_thread(stop_and_read, stack)
    for name in REBUILT:
        delete_database(stack.data_dir, name)
    for name in REBUILT:
        await asyncio.to_thread(stack.restart, name)
    after = await asyncio.to_thread(stop_and_read, stack)

    assert await event_log.last_seq() == tip, "the log changed while the projections were rebuilt"
    assert before["governor"][0] == tip
    assert before["router"][0] == tip
    assert before["router"][1], "the router's projection should not be empty"
    assert before["governor"][1], "the governor's projection should hold the live agents"
    for name in REBUILT:
        assert after[name][1] == before[name][1], f"{name} rows"
        if name == "artifacts":
            # Once caught up, the artifact-store is sent only spawns, forks and artifacts: its
            # checkpoint stood at the last of those, where the rebuild read to the log's end.
            assert before[name][0] <= after[name][0] == tip, f"{name} checkpoint"
        else:
            assert after[name][0] == before[name][0], f"{name} checkpoint"


async def test_services_whose_stream_was_made_again_fold_the_new_one_from_its_start(
    make_stack: StackFactory, event_log: EventLog
) -> None:
    """The stream is deleted and made again (sequences start at 1 again) while the services'
    databases stay: each service rebuilds its state from the new log instead of passing over
    its first events as already folded."""
    stack = await asyncio.to_thread(make_stack)
    client = GroveClient(event_log)
    earlier = [await client.spawn("go", python_agent("quick")) for _ in range(4)]
    await wait_ended(event_log, earlier, timeout=30)
    await asyncio.to_thread(stack.stop)
    before = {name: projection_of(stack.data_dir, name)[0] for name in REBUILT}
    # The artifact-store's checkpoint stands at the last spawn (it is sent only spawns, forks
    # and artifacts once caught up); the others' at the log's end.
    assert before["governor"] >= 20, before
    assert before["router"] >= 20, before
    assert before["artifacts"] >= 4, before

    await event_log.js.delete_stream(event_log.stream)
    await event_log.ensure_stream()
    await asyncio.to_thread(stack.start)
    agent = await client.spawn("go", python_agent("quick"))
    ended = await wait_ended(event_log, [agent], timeout=30)
    assert ended[agent].reason == "completed"
    tip = await event_log.last_seq()
    assert tip < min(before["governor"], before["router"])

    after = await asyncio.to_thread(stop_and_read, stack)
    assert after["router"][0] == after["governor"][0] == tip
    nodes = {key.removeprefix("node:") for key in after["router"][1] if key.startswith("node:")}
    assert nodes == {agent}, "the router kept the old stream's agents"
    # The artifact-store too folded the new stream from its start, not from its old checkpoint.
    assert set(after["artifacts"][1]) == {f"agent:{agent}"}, "the index kept the old agents"


# -- malformed messages -------------------------------------------------------------------------


async def metric_total(
    session: aiohttp.ClientSession, port: int, metric: str, **labels: str
) -> float:
    async with session.get(f"http://127.0.0.1:{port}/metrics") as response:
        assert response.status == 200
        text = await response.text()
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == metric and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


async def wait_metric(
    session: aiohttp.ClientSession, port: int, metric: str, at_least: float, **labels: str
) -> None:
    while True:
        if await metric_total(session, port, metric, **labels) >= at_least:
            return
        await asyncio.sleep(0.1)


async def test_malformed_messages_are_dead_lettered_once_and_the_services_go_on(
    make_stack: StackFactory, event_log: EventLog
) -> None:
    stack = await asyncio.to_thread(make_stack)
    not_json_agent, wrong_schema_agent = new_id(), new_id()
    not_json = await event_log.js.publish(f"grove.spawn.{not_json_agent}", b"{this is not json")
    wrong_schema = await event_log.js.publish(
        f"grove.spawn.{wrong_schema_agent}",
        json.dumps(
            {"event_id": new_id(), "type": "spawn", "agent_id": wrong_schema_agent, "task": "x"}
        ).encode(),
    )
    client = GroveClient(event_log)
    valid = await client.spawn("go", python_agent("quick"))

    assert (await wait_ended(event_log, [valid], timeout=20))[valid].reason == "completed"

    async with aiohttp.ClientSession() as session, asyncio.timeout(20):
        for service in stack.services.values():
            if not service.name.startswith("spawner"):  # its projection reads no spawns
                await wait_metric(
                    session, service.http_port, "grove_deadletters_total", 2, kind="spawn"
                )
            for probe in ("healthz", "readyz"):
                async with session.get(f"http://127.0.0.1:{service.http_port}/{probe}") as resp:
                    assert resp.status == 200, f"{service.name} /{probe}"
    await asyncio.sleep(0.5)

    async with asyncio.timeout(20):
        letters = [r async for r in event_log.read(1) if r.subject.startswith("grove.deadletter.")]
    assert sorted(r.subject for r in letters) == sorted(
        [f"grove.deadletter.spawn.{not_json.seq}", f"grove.deadletter.spawn.{wrong_schema.seq}"]
    )
    bodies = {r.subject: json.loads(r.data) for r in letters}
    first = bodies[f"grove.deadletter.spawn.{not_json.seq}"]
    assert first["source_seq"] == not_json.seq
    assert first["subject"] == f"grove.spawn.{not_json_agent}"
    assert "not JSON" in first["error"]
    second = bodies[f"grove.deadletter.spawn.{wrong_schema.seq}"]
    assert second["source_seq"] == wrong_schema.seq
    assert "config" in second["error"]

    records = await history(event_log)
    assert not {not_json_agent, wrong_schema_agent} & {r.event.agent_id for r in records}

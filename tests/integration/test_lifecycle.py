"""Agent lifecycle against a real nats-server and the services as processes.

Admission under a capacity limit, exactly one start per admitted agent (also when the admission
is duplicated and when two spawners share the work), commands as agents, and a producer that
knows nothing of AgentGrove but its subjects and JSON.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from pathlib import Path

import nats
import pytest

from agentgrove.client import GroveClient, build_config
from agentgrove.stack import Stack
from grove_core.log import EventLog
from grove_core.records import Recorded
from grove_events import AgentConfig, SpawnEvent, StatusEvent, TerminateEvent, new_id
from tests.integration.test_message_rate import scrape

pytestmark = pytest.mark.integration

AT_CAPACITY = "system at capacity, retry later"

StackFactory = Callable[..., Stack]


# -- reading the log back ------------------------------------------------------------------


async def history(event_log: EventLog) -> list[Recorded]:
    """Every valid event, by a replay to the current tip."""
    async with asyncio.timeout(30):
        return [item async for item in event_log.events(1) if isinstance(item, Recorded)]


def statuses(records: Iterable[Recorded], status_type: str) -> list[Recorded]:
    return [
        r
        for r in records
        if isinstance(r.event, StatusEvent) and r.event.status_type == status_type
    ]


def terminates(records: Iterable[Recorded]) -> list[Recorded]:
    return [r for r in records if isinstance(r.event, TerminateEvent)]


def per_agent(records: Iterable[Recorded]) -> Counter[str]:
    return Counter(r.event.agent_id for r in records)


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


async def wait_events(
    event_log: EventLog, matches: Callable[[Recorded], bool], count: int, timeout: float
) -> list[Recorded]:
    """The first `count` events that match, waiting for those not there yet."""
    found: list[Recorded] = []
    async with asyncio.timeout(timeout):
        async for item in event_log.events(1, follow=True):
            if isinstance(item, Recorded) and matches(item):
                found.append(item)
                if len(found) == count:
                    break
    return found


def is_status(
    status_type: str, agent_ids: Iterable[str] | None = None
) -> Callable[[Recorded], bool]:
    wanted = None if agent_ids is None else set(agent_ids)

    def matches(record: Recorded) -> bool:
        event = record.event
        return (
            isinstance(event, StatusEvent)
            and event.status_type == status_type
            and (wanted is None or event.agent_id in wanted)
        )

    return matches


def metric(port: int, name: str) -> float | None:
    """The first sample of a metric on a service's /metrics (None: none yet)."""
    for line in scrape(port).splitlines():
        if line.startswith((name + " ", name + "{")):
            return float(line.rsplit(" ", 1)[1])
    return None


async def wait_spawners_decided(stack: Stack, seq: int, timeout: float = 15) -> None:
    """Wait until every spawner has folded the log up to `seq` and has decided on every
    admission it holds (`grove_spawner_admissions_waiting` is 0).

    A spawner decides on an admission only after appending `started` when it starts the
    agent, so past this point every start the admissions up to `seq` caused is in the log.
    """
    spawners = [s for name, s in stack.services.items() if name.startswith("spawner")]
    async with asyncio.timeout(timeout):
        while True:
            samples = [
                (
                    await asyncio.to_thread(metric, s.http_port, "grove_projection_applied_seq"),
                    await asyncio.to_thread(
                        metric, s.http_port, "grove_spawner_admissions_waiting"
                    ),
                )
                for s in spawners
            ]
            if all((applied or 0) >= seq and waiting == 0 for applied, waiting in samples):
                return
            await asyncio.sleep(0.1)


def python_agent(entrypoint: str) -> AgentConfig:
    return build_config("python", entrypoint=f"tests.agents:{entrypoint}")


async def duplicate_admission(event_log: EventLog, agent_id: str) -> int:
    """Append another `admitted` for an agent (new event id, same agent); its sequence."""
    admitted = statuses(await history(event_log), "admitted")
    original = next(r.event for r in admitted if r.event.agent_id == agent_id)
    copy = StatusEvent(
        event_id=new_id(),
        agent_id=agent_id,
        tree_id=original.tree_id,
        timestamp=datetime.now(UTC),
        causation_id=original.causation_id,
        status_type="admitted",
    )
    return (await event_log.append(copy)).seq


# -- admission ---------------------------------------------------------------------------


CAPACITY_TWO = """
resources:
  global:
    max_concurrent_agents: 2
"""


async def test_at_capacity_a_spawn_is_rejected_and_a_stop_frees_a_slot(
    make_stack: StackFactory, event_log: EventLog
) -> None:
    await asyncio.to_thread(make_stack, config=CAPACITY_TWO)
    client = GroveClient(event_log)
    sleepers = [await client.spawn("30", python_agent("sleeper")) for _ in range(3)]
    first, second, third = sleepers

    ended = await wait_ended(event_log, [third], timeout=20)
    assert ended[third].reason == "rejected"
    assert ended[third].error == AT_CAPACITY
    await wait_events(event_log, is_status("started", sleepers), 2, timeout=20)

    records = await history(event_log)
    assert sorted(per_agent(statuses(records, "admitted"))) == sorted([first, second])
    assert sorted(per_agent(statuses(records, "started"))) == sorted([first, second])
    rejected = statuses(records, "rejected")
    assert [r.event.agent_id for r in rejected] == [third]
    assert rejected[0].event.payload.summary == AT_CAPACITY
    assert per_agent(terminates(records)) == Counter({third: 1})

    await client.stop(first, "make room")
    assert (await wait_ended(event_log, [first], timeout=20))[first].reason == "stopped"

    admitted_after_stop = await client.spawn("30", python_agent("sleeper"))
    await wait_events(event_log, is_status("started", [admitted_after_stop]), 1, timeout=20)
    over_capacity = await client.spawn("30", python_agent("sleeper"))
    ended = await wait_ended(event_log, [over_capacity], timeout=20)
    assert ended[over_capacity].reason == "rejected"
    assert ended[over_capacity].error == AT_CAPACITY

    records = await history(event_log)
    admitted = per_agent(statuses(records, "admitted"))
    assert admitted == Counter({first: 1, second: 1, admitted_after_stop: 1})


# -- exactly one start ---------------------------------------------------------------------


async def test_a_duplicated_admission_of_a_finished_agent_does_not_run_it_again(
    make_stack: StackFactory, event_log: EventLog, tmp_path: Path
) -> None:
    stack = await asyncio.to_thread(make_stack)
    client = GroveClient(event_log)
    runs = tmp_path / "runs.txt"
    agent = await client.spawn(
        "record",
        build_config("command", command=["sh", "-c", f"cat >/dev/null; echo ran >> {runs}"]),
    )
    assert (await wait_ended(event_log, [agent], timeout=20))[agent].reason == "completed"

    seq = await duplicate_admission(event_log, agent)
    await wait_spawners_decided(stack, seq)
    await asyncio.sleep(1.0)  # a second run, had it started, would have written by now

    records = await history(event_log)
    assert per_agent(statuses(records, "admitted"))[agent] == 2
    assert per_agent(statuses(records, "started"))[agent] == 1
    assert per_agent(terminates(records))[agent] == 1
    assert runs.read_text().splitlines() == ["ran"]


async def test_a_duplicated_admission_of_a_running_agent_does_not_start_it_again(
    make_stack: StackFactory, event_log: EventLog, tmp_path: Path
) -> None:
    stack = await asyncio.to_thread(make_stack, spawners=2)
    client = GroveClient(event_log)
    runs = tmp_path / "runs.txt"
    agent = await client.spawn(
        json.dumps({"path": str(runs), "sleep": 6}), python_agent("record_run")
    )
    await wait_events(event_log, is_status("started", [agent]), 1, timeout=20)

    # Several copies, so that the spawner not running the agent gets at least one.
    last = 0
    for _ in range(4):
        last = await duplicate_admission(event_log, agent)
        await asyncio.sleep(0.2)
    await wait_spawners_decided(stack, last)
    await asyncio.sleep(0.5)

    records = await history(event_log)
    assert per_agent(statuses(records, "started"))[agent] == 1
    assert runs.read_text().splitlines() == [agent]
    await client.stop(agent)
    await wait_ended(event_log, [agent], timeout=20)


async def test_two_spawners_share_the_work_and_start_each_agent_once(
    make_stack: StackFactory, event_log: EventLog
) -> None:
    await asyncio.to_thread(make_stack, spawners=2)
    client = GroveClient(event_log)
    agents = []
    for _ in range(10):
        agents += [await client.spawn("go", python_agent("quick")) for _ in range(5)]
        await asyncio.sleep(0.05)

    ended = await wait_ended(event_log, agents, timeout=60)
    assert {e.reason for e in ended.values()} == {"completed"}

    await asyncio.sleep(0.5)
    records = await history(event_log)
    started = statuses(records, "started")
    assert per_agent(started) == Counter(dict.fromkeys(agents, 1))
    assert per_agent(terminates(records)) == Counter(dict.fromkeys(agents, 1))
    spawner_ids = Counter(r.event.payload.details["spawner_id"] for r in started)
    assert set(spawner_ids) == {"spawner-1", "spawner-2"}, spawner_ids


# -- commands and outside producers ------------------------------------------------------------


async def test_a_command_that_does_not_read_its_stdin_completes(
    make_stack: StackFactory, event_log: EventLog
) -> None:
    await asyncio.to_thread(make_stack)
    client = GroveClient(event_log)
    agents = [
        await client.spawn("greet", build_config("command", command=["echo", "hello"]))
        for _ in range(20)
    ]

    ended = await wait_ended(event_log, agents, timeout=30)

    failed = [e.error for e in ended.values() if e.reason != "completed"]
    assert not failed, f"{len(failed)} of 20 failed, the first with: {failed[0]}"
    assert {e.result.summary for e in ended.values()} == {"hello\n"}


async def test_an_external_producer_with_plain_nats_and_json_gets_its_agent_run(
    make_stack: StackFactory, event_log: EventLog
) -> None:
    stack = await asyncio.to_thread(make_stack)
    agent_id = str(uuid.uuid4())
    event_id = str(uuid.uuid4())
    body = json.dumps(
        {
            "event_id": event_id,
            "type": "spawn",
            "agent_id": agent_id,
            "task": "shout this",
            "config": {"runtime": "command", "command": ["tr", "a-z", "A-Z"]},
        }
    ).encode()

    nc = await nats.connect(stack.url)
    try:
        js = nc.jetstream()
        headers = {"Nats-Msg-Id": event_id}
        ack = await js.publish(f"grove.spawn.{agent_id}", body, headers=headers)
        retry = await js.publish(f"grove.spawn.{agent_id}", body, headers=headers)
    finally:
        await nc.close()
    assert not ack.duplicate
    assert retry.duplicate
    assert retry.seq == ack.seq

    recorded = await event_log.wait_for(f"grove.terminate.{agent_id}", timeout=20)

    event = recorded.event
    assert isinstance(event, TerminateEvent)
    assert event.reason == "completed"
    assert event.result.summary == "SHOUT THIS"
    assert event.error is None
    spawns = [r for r in await history(event_log) if isinstance(r.event, SpawnEvent)]
    assert [(r.seq, r.event.event_id, r.event.tree_id) for r in spawns] == [
        (ack.seq, event_id, agent_id)
    ]

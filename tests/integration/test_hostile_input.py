"""Hostile input against the running services: a flood of malformed messages is dead-lettered
once each with its reason and changes nothing; forged spawns are refused with a reason."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Callable, Iterator

import aiohttp
import pytest

from agentgrove.client import GroveClient
from agentgrove.routing import RouterError
from grove_core.log import EventLog
from grove_events import KINDS, ResultSummary, TerminateEvent, new_id
from tests.conftest import StackFactory
from tests.integration.test_recovery import (
    ROOMY,
    count_statuses,
    history,
    python_agent,
    wait_ended,
    wait_metric,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

#: How many malformed messages the flood holds.
FLOOD = 150


def _valid_body(kind: str, agent: str) -> dict[str, object]:
    bodies: dict[str, dict[str, object]] = {
        "spawn": {"task": "t", "config": {"runtime": "command", "command": ["true"]}},
        "status": {"status_type": "checkpoint"},
        "terminate": {"reason": "completed"},
        "control": {"action": "stop"},
    }
    return {"event_id": new_id(), "type": kind, "agent_id": agent, **bodies.get(kind, {})}


def malformed(rng: random.Random) -> Iterator[tuple[str, bytes]]:
    """(subject, data) pairs that are not valid events, of every shape of damage."""
    damages: list[Callable[[str, str], bytes]] = [
        lambda kind, agent: rng.randbytes(rng.randint(0, 200)),
        lambda kind, agent: json.dumps(_valid_body(kind, agent)).encode()[: rng.randint(1, 40)],
        lambda kind, agent: json.dumps([1, 2, {"type": kind}]).encode(),
        lambda kind, agent: json.dumps(
            {**_valid_body(kind, agent), "agent_id": "someone"}
        ).encode(),
        lambda kind, agent: json.dumps({**_valid_body(kind, agent), "type": "nonsense"}).encode(),
        lambda kind, agent: json.dumps({**_valid_body(kind, agent), "event_id": 42}).encode(),
        lambda kind, agent: json.dumps({**_valid_body(kind, agent), "surprise": True}).encode(),
        lambda kind, agent: json.dumps(
            {**_valid_body(kind, agent), "schema_version": "2"}
        ).encode(),
        lambda kind, agent: json.dumps(
            {**_valid_body(kind, agent), "task": "\U0001f333" * 100_001}, ensure_ascii=False
        ).encode(),
        lambda kind, agent: "\u202e\x00\ufffd".encode() * 10,
    ]
    for index in range(FLOOD):
        kind = rng.choice(["spawn", "status", "terminate", "control"])
        agent = new_id()
        yield f"grove.{kind}.{agent}", damages[index % len(damages)](kind, agent)


async def test_a_flood_of_malformed_messages_is_dead_lettered_once_each(
    make_stack: StackFactory, event_log: EventLog
) -> None:
    stack = await asyncio.to_thread(make_stack, config=ROOMY)
    rng = random.Random(20261203)
    bad: dict[int, str] = {}
    for subject, data in malformed(rng):
        ack = await event_log.js.publish(subject, data)
        bad[ack.seq] = subject
    client = GroveClient(event_log)
    valid = await client.spawn("after the flood", python_agent("quick"))

    assert (await wait_ended(event_log, [valid], timeout=60))[valid].reason == "completed"
    letters: dict[int, dict[str, object]] = {}
    async with asyncio.timeout(60):
        while len(letters) < len(bad):
            letters = {}
            async for record in event_log.read(1, subjects="grove.deadletter.>"):
                body = json.loads(record.data)
                assert int(body["source_seq"]) not in letters, "dead-lettered twice"
                letters[int(body["source_seq"])] = body
            await asyncio.sleep(0.2)
    assert set(letters) == set(bad)
    assert all(letters[seq]["subject"] == subject for seq, subject in bad.items())
    assert all(isinstance(b["error"], str) and b["error"] for b in letters.values())
    records = await history(event_log)
    assert {r.event.agent_id for r in records} == {valid}
    assert all(service.alive for service in stack.services.values())
    assert set(KINDS) >= {subject.split(".")[1] for subject in bad.values()}


async def test_a_forged_child_of_another_tree_is_refused_with_the_reason(
    make_stack: StackFactory, event_log: EventLog
) -> None:
    await asyncio.to_thread(make_stack, config=ROOMY)
    client = GroveClient(event_log)
    victim = await client.spawn("60", python_agent("sleeper"))
    attacker = await client.spawn("60", python_agent("sleeper"))
    await wait_started(event_log, [victim, attacker])

    forged = await client.spawn(
        "escape my budget", python_agent("quick"), parent=victim, tree_id=attacker
    )
    orphan = await client.spawn("no parent", python_agent("quick"), parent=new_id())

    ended = await wait_ended(event_log, [forged, orphan], timeout=30)
    assert ended[forged].reason == "rejected"
    assert ended[forged].error == (
        f"refused: parent {victim} belongs to tree {victim}, not to tree {attacker}"
    )
    assert ended[orphan].reason == "rejected"
    assert "is not an agent the log knows" in (ended[orphan].error or "")
    records = await history(event_log)
    assert not count_statuses(records, "started")[forged]
    await client.stop(victim)
    await client.stop(attacker)


async def wait_started(event_log: EventLog, agents: list[str]) -> None:
    """Wait until every agent has started."""
    async with asyncio.timeout(30):
        while True:
            started = count_statuses(await history(event_log), "started")
            if all(started[a] for a in agents):
                return
            await asyncio.sleep(0.1)


async def test_the_end_of_an_agent_that_never_was_is_refused_and_recorded(
    make_stack: StackFactory, event_log: EventLog
) -> None:
    stack = await asyncio.to_thread(make_stack)
    ghost = new_id()
    await event_log.append(
        TerminateEvent(
            event_id=new_id(),
            agent_id=ghost,
            reason="completed",
            result=ResultSummary(summary="I was never here"),
        )
    )
    router = stack.services["router"]
    async with aiohttp.ClientSession() as session, asyncio.timeout(20):
        await wait_metric(
            session, router.http_port, "grove_router_refused_events_total", 1, kind="terminate"
        )
    assert (
        f"terminate of {ghost}, an agent the log never spawned or forked"
        in (stack.data_dir / "logs" / "router.log").read_text()
    )
    with pytest.raises(RouterError, match="no agent"):
        await GroveClient(event_log).summary(ghost)

"""The resource-governor against a real nats-server and real service processes: every row of
the limits table, queue order across a restart, timeouts, the emergency brake, the RPC."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from agentgrove import GroveClient, build_config
from agentgrove.results import AgentResult
from grove_core.log import EventLog
from grove_core.records import Recorded
from grove_events import ControlEvent, ForkEvent, StatusEvent, TerminateEvent, new_id
from tests.conftest import NatsEndpoint, StackFactory

pytestmark = pytest.mark.integration

SLEEPER = build_config("python", entrypoint="tests.agents:sleeper")
QUICK = build_config("python", entrypoint="tests.agents:quick")


@pytest.fixture
async def client(nats_server: NatsEndpoint) -> AsyncIterator[GroveClient]:
    async with await GroveClient.connect(nats_server.url) as grove:
        yield grove


async def statuses(log: EventLog, agent_id: str) -> list[StatusEvent]:
    out = []
    async for item in log.events(1, subjects=f"grove.status.{agent_id}"):
        if isinstance(item, Recorded) and isinstance(item.event, StatusEvent):
            out.append(item.event)
    return out


async def wait_status(log: EventLog, agent_id: str, status_type: str, timeout: float = 20) -> None:
    async def seen() -> None:
        async for item in log.events(1, subjects=f"grove.status.{agent_id}", follow=True):
            if isinstance(item, Recorded) and getattr(item.event, "status_type", "") == status_type:
                return

    await asyncio.wait_for(seen(), timeout)


async def test_capacity_and_child_limits_reject_with_the_seed_messages(
    make_stack: StackFactory, client: GroveClient
) -> None:
    make_stack(config="resources:\n  global:\n    max_concurrent_agents: 3\n")
    boss = await client.spawn("30", SLEEPER)
    await wait_status(client.log, boss, "started")
    limited = build_config(
        "python",
        entrypoint="tests.agents:sleeper",
        resource_limits={"per_parent": {"max_children": 1}},
    )
    parent = await client.spawn("30", limited)
    await wait_status(client.log, parent, "started")
    first = await client.spawn("30", SLEEPER, parent=parent)
    await wait_status(client.log, first, "started")
    second = await client.spawn("30", SLEEPER, parent=parent)
    rejected = await client.wait(second, timeout=20)
    assert (rejected.reason, rejected.error) == ("rejected", "max children reached")
    over = await client.spawn("30", SLEEPER)
    full = await client.wait(over, timeout=20)
    assert (full.reason, full.error) == ("rejected", "system at capacity, retry later")
    for agent in (boss, parent, first):
        await client.stop(agent)


async def test_depth_and_tree_budgets_name_the_limit(
    make_stack: StackFactory, client: GroveClient
) -> None:
    make_stack(config="resources:\n  per_tree:\n    max_depth: 1\n    max_agents: 3\n")
    root = await client.spawn("30", SLEEPER)
    await wait_status(client.log, root, "started")
    kid = await client.spawn("30", SLEEPER, parent=root)
    await wait_status(client.log, kid, "started")
    grandkid = await client.spawn("1", QUICK, parent=kid)
    too_deep = await client.wait(grandkid, timeout=20)
    assert too_deep.reason == "rejected"
    assert "per_tree.max_depth=1" in (too_deep.error or "")
    fork_id = await client_fork(client, kid)
    forked = await client.wait(fork_id, timeout=20)
    assert forked.reason == "completed"
    third = await client.spawn("1", QUICK, parent=root)
    over_budget = await client.wait(third, timeout=20)
    assert over_budget.reason == "rejected"
    assert "per_tree.max_agents=3" in (over_budget.error or "")
    await client.stop(kid)
    await client.stop(root)


async def client_fork(client: GroveClient, source: str) -> str:
    """A fork counts against its source's tree (the third agent of this tree)."""
    fork_id = new_id()
    await client.log.append(
        ForkEvent(
            event_id=new_id(),
            agent_id=fork_id,
            source_agent=source,
            reason="try another way",
            task="0.5",
        )
    )
    return fork_id


async def test_rate_limit_queues_in_order_and_survives_a_governor_restart(
    make_stack: StackFactory, client: GroveClient
) -> None:
    stack = make_stack(config="resources:\n  global:\n    max_spawn_rate: 2\n")
    ids = [await client.spawn(f"n{i}", QUICK) for i in range(8)]
    await wait_status(client.log, ids[4], "queued")
    stack.services["governor"].kill()
    await asyncio.sleep(1.0)
    stack.restart("governor")
    results: list[AgentResult] = [await client.wait(agent, timeout=30) for agent in ids]
    assert [r.reason for r in results] == ["completed"] * 8
    admitted_order = []
    async for item in client.log.events(1, subjects="grove.status.*"):
        event = item.event if isinstance(item, Recorded) else None
        if isinstance(event, StatusEvent) and event.status_type == "admitted":
            admitted_order.append(event.agent_id)
    assert admitted_order == ids  # arrival order, each once
    queued = [s for s in await statuses(client.log, ids[-1]) if s.status_type == "queued"]
    assert queued, "the last spawn should have waited in the queue"


async def test_runtime_limit_gives_notice_then_stops(
    make_stack: StackFactory, client: GroveClient
) -> None:
    make_stack(GROVE_TIMEOUT_GRACE="1")
    limited = build_config(
        "python",
        entrypoint="tests.agents:sleeper",
        resource_limits={"per_agent": {"max_runtime": 1}},
    )
    agent = await client.spawn("30", limited)
    result = await client.wait(agent, timeout=30)
    assert result.reason == "timeout"
    assert "per_agent.max_runtime" in (result.error or "")
    kinds = [s.status_type for s in await statuses(client.log, agent)]
    assert kinds.index("timeout_notice") > kinds.index("started")
    terminates = [
        item
        async for item in client.log.events(1, subjects=f"grove.terminate.{agent}")
        if isinstance(item, Recorded) and isinstance(item.event, TerminateEvent)
    ]
    assert len(terminates) == 1


async def test_token_budget_from_reported_usage_stops_the_agent(
    make_stack: StackFactory, client: GroveClient
) -> None:
    make_stack(GROVE_TIMEOUT_GRACE="1")
    limited = build_config(
        "python",
        entrypoint="tests.agents:sleeper",
        resource_limits={"per_agent": {"max_tokens": 100}},
    )
    agent = await client.spawn("30", limited)
    await wait_status(client.log, agent, "started")
    await client.log.append(
        StatusEvent(
            event_id=new_id(),
            agent_id=agent,
            status_type="checkpoint",
            payload={"summary": "thinking hard", "details": {"tokens": 250}},
        )
    )
    result = await client.wait(agent, timeout=30)
    assert result.reason == "timeout"
    assert "per_agent.max_tokens" in (result.error or "")


async def test_pause_all_holds_admissions_until_resume_all(
    make_stack: StackFactory, client: GroveClient
) -> None:
    make_stack()
    await client.log.append(ControlEvent(event_id=new_id(), agent_id="ops", action="pause_all"))
    agent = await client.spawn("quick", QUICK)
    await wait_status(client.log, agent, "queued")
    await asyncio.sleep(1.0)
    assert "admitted" not in [s.status_type for s in await statuses(client.log, agent)]
    await client.log.append(ControlEvent(event_id=new_id(), agent_id="ops", action="resume_all"))
    assert (await client.wait(agent, timeout=20)).reason == "completed"


async def test_stop_before_start_cancels(make_stack: StackFactory, client: GroveClient) -> None:
    make_stack()
    await client.log.append(ControlEvent(event_id=new_id(), agent_id="ops", action="pause_all"))
    agent = await client.spawn("quick", QUICK)
    await wait_status(client.log, agent, "queued")
    await client.stop(agent, "not needed")
    result = await client.wait(agent, timeout=20)
    assert (result.reason, result.error) == ("cancelled", "not needed")
    await client.log.append(ControlEvent(event_id=new_id(), agent_id="ops", action="resume_all"))


async def test_resource_status_over_request_reply(
    make_stack: StackFactory, client: GroveClient
) -> None:
    make_stack(config="resources:\n  global:\n    max_concurrent_agents: 4\n")
    limited = build_config(
        "python",
        entrypoint="tests.agents:sleeper",
        resource_limits={"per_parent": {"max_children": 2}},
    )
    boss = await client.spawn("30", limited)
    kid = await client.spawn("30", SLEEPER, parent=boss)
    await wait_status(client.log, kid, "started")
    reply = await client.log.nc.request(
        "grove.rpc.governor.status", json.dumps({"agent_id": boss}).encode(), timeout=5
    )
    answer = json.loads(reply.data)
    assert answer["global"]["agents_running"] == 2
    assert answer["global"]["capacity"] == 4
    assert answer["global"]["utilization"] == 0.5
    assert answer["self"]["children_running"] == 1
    assert answer["self"]["children_limit"] == 2
    assert answer["self"]["runtime_elapsed"] > 0
    await client.stop(kid)
    await client.stop(boss)


async def admissions(log: EventLog) -> list[StatusEvent]:
    """Every `admitted` status in the log, in log order."""
    return [
        item.event
        async for item in log.events(1, subjects="grove.status.*")
        if isinstance(item, Recorded)
        and isinstance(item.event, StatusEvent)
        and item.event.status_type == "admitted"
    ]


async def test_parent_spawn_rate_queues_its_children_in_arrival_order(
    make_stack: StackFactory, client: GroveClient
) -> None:
    rate = 2
    make_stack(config=f"resources:\n  per_parent:\n    max_spawn_rate: {rate}\n")
    busy = await client.spawn("30", SLEEPER)
    other = await client.spawn("30", SLEEPER)
    await wait_status(client.log, busy, "started")
    await wait_status(client.log, other, "started")
    kids = [await client.spawn(f"k{i}", QUICK, parent=busy) for i in range(6)]
    others = [await client.spawn(f"o{i}", QUICK, parent=other) for i in range(2)]

    results = [await client.wait(agent, timeout=30) for agent in [*kids, *others]]
    assert [r.reason for r in results] == ["completed"] * 8
    admitted_in_order = await admissions(client.log)
    assert [s.agent_id for s in admitted_in_order if s.agent_id in kids] == kids  # each once
    admitted = {s.agent_id: s for s in admitted_in_order}
    queued = {}
    for kid in kids:
        waits = [s for s in await statuses(client.log, kid) if s.status_type == "queued"]
        if waits:
            queued[kid] = waits[0].payload.summary
    assert set(kids[3:]) <= set(queued), "a burst of 2, then 2/s: the later ones wait"
    assert all("per_parent.max_spawn_rate" in why for why in queued.values()), queued
    # Burst of `rate`, then `rate` per second: the sixth is admitted two seconds after the first.
    first, last = admitted[kids[0]].timestamp, admitted[kids[-1]].timestamp
    assert first is not None
    assert last is not None
    assert (last - first).total_seconds() >= (len(kids) - rate) / rate - 0.01
    # The rate is the parent's: another parent's children did not wait behind them.
    for agent in others:
        assert "queued" not in [s.status_type for s in await statuses(client.log, agent)]
    for agent in (busy, other):
        await client.stop(agent)


async def test_tree_token_budget_rejects_new_spawns_and_stops_the_tree(
    make_stack: StackFactory, client: GroveClient
) -> None:
    make_stack(config="resources:\n  per_tree:\n    max_tokens: 1000\n", GROVE_TIMEOUT_GRACE="2")
    root = await client.spawn("30", SLEEPER)
    await wait_status(client.log, root, "started")
    kid = await client.spawn("30", SLEEPER, parent=root)
    bystander = await client.spawn("30", SLEEPER)
    await wait_status(client.log, kid, "started")
    await wait_status(client.log, bystander, "started")
    # Each agent is under any budget of its own; together the tree is over its budget.
    for agent, tokens in ((kid, 600), (root, 500), (bystander, 900)):
        await client.log.append(
            StatusEvent(
                event_id=new_id(),
                agent_id=agent,
                status_type="checkpoint",
                payload={"summary": "working", "details": {"tokens": tokens}},
            )
        )
    await wait_status(client.log, root, "timeout_notice")
    late = await client.spawn("1", QUICK, parent=root)
    refused = await client.wait(late, timeout=20)
    assert refused.reason == "rejected"
    assert "per_tree.max_tokens=1000" in (refused.error or "")

    for agent in (root, kid):
        stopped = await client.wait(agent, timeout=30)
        assert stopped.reason == "timeout"
        assert "per_tree.max_tokens" in (stopped.error or "")
    # Another tree's agents are not charged for this tree's usage.
    kinds = [s.status_type for s in await statuses(client.log, bystander)]
    assert "timeout_notice" not in kinds
    await client.stop(bystander)
    assert (await client.wait(bystander, timeout=20)).reason == "stopped"

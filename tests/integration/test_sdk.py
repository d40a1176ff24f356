"""The SDK's watch over a tree's events, and the synchronous client for scripts."""

from __future__ import annotations

import asyncio

import pytest

from agentgrove import SyncGroveClient
from agentgrove.client import GroveClient
from grove_core.log import EventLog
from grove_core.records import Recorded
from tests.conftest import NatsEndpoint, StackFactory
from tests.integration.test_recovery import python_agent

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


async def test_watch_follows_one_tree_and_nothing_else(
    make_stack: StackFactory, event_log: EventLog
) -> None:
    await asyncio.to_thread(make_stack)
    client = GroveClient(event_log)
    root = await client.spawn("2", python_agent("spawns_children"))
    seen: list[Recorded] = []
    statuses: list[Recorded] = []

    async def watch_all() -> None:
        async for recorded in client.watch(root, from_seq=1):
            seen.append(recorded)
            if recorded.event.type == "terminate" and recorded.event.agent_id == root:
                return

    async def watch_statuses() -> None:
        async for recorded in client.watch(root, kinds=["status"], from_seq=1):
            statuses.append(recorded)
            if recorded.event.agent_id == root and getattr(recorded.event, "status_type", "") in (
                "completed",
                "failed",
            ):
                return

    watching = asyncio.gather(watch_all(), watch_statuses())
    other = await client.spawn("unrelated", python_agent("quick"))
    await asyncio.wait_for(watching, 40)

    agents = {r.event.agent_id for r in seen}
    assert root in agents
    assert len(agents) == 3, "the root and its two children"
    assert other not in agents
    assert {r.event.type for r in statuses} == {"status"}
    assert [r.seq for r in seen] == sorted(r.seq for r in seen)
    with pytest.raises(ValueError, match="not both"):
        await anext(client.watch(root, agent_id=root))


def test_the_sync_client_spawns_and_waits_without_asyncio(
    nats_server: NatsEndpoint, make_stack: StackFactory
) -> None:
    make_stack()
    with SyncGroveClient(nats_server.url) as client:
        agent = client.spawn("quick", python_agent("quick"))
        result = client.wait(agent, timeout=30)
        assert result.reason == "completed"
        assert client.summary(agent)["agent_id"] == agent
        assert set(client.resource_status()["global"]) >= {"agents_running", "capacity"}
        with pytest.raises(AttributeError, match="watch"):
            client.watch(agent)

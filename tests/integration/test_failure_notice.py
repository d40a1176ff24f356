"""The failure flow against a real nats-server and the services as processes: a child's
`failed` status, with what it attempted and its partial results, reaches its parent's inbox
(its progress does not), and waiting on the child gives the same."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from agentgrove import GroveClient, build_config
from grove_core.records import Recorded
from grove_events import StatusEvent
from tests.conftest import NatsEndpoint, StackFactory

pytestmark = pytest.mark.integration

MANAGER = build_config("python", entrypoint="tests.governance_agents:manages_a_failure")
#: What `tests.lifecycle_agents:fails` reports when it fails.
FAILURE = {
    "error": "RuntimeError: the door is locked",
    "attempted": ["tried the front door"],
    "partial_results": ["half a map"],
}


@pytest.fixture
async def client(nats_server: NatsEndpoint) -> AsyncIterator[GroveClient]:
    async with await GroveClient.connect(nats_server.url) as grove:
        yield grove


async def test_a_parent_reads_its_child_s_failure_with_what_it_attempted(
    make_stack: StackFactory, client: GroveClient
) -> None:
    await asyncio.to_thread(make_stack)
    parent = await client.spawn("manage a failure", MANAGER)
    result = await client.wait(parent, timeout=60)
    assert result.reason == "completed", result.error
    report = json.loads(result.summary)
    child = report["child"]

    # The failure notice, then the end; the child's start and checkpoint stay out.
    notices = [(e["type"], e["via"], e["source"], e.get("status_type")) for e in report["inbox"]]
    assert notices == [
        ("status", f"subtree:{child}", child, "failed"),
        ("terminate", f"subtree:{child}", child, None),
    ]
    assert report["inbox"][0]["details"] == FAILURE
    assert report["waited"] == {"reason": "failed", **FAILURE}

    waited = await client.wait(child, timeout=10)
    assert (waited.reason, waited.error) == ("failed", FAILURE["error"])
    assert list(waited.attempted) == FAILURE["attempted"]
    assert list(waited.partial_results) == FAILURE["partial_results"]
    statuses = [
        item.event.status_type
        async for item in client.log.events(1, subjects=f"grove.status.{child}")
        if isinstance(item, Recorded) and isinstance(item.event, StatusEvent)
    ]
    assert statuses.count("started") == 1, "a failed child is not retried"
    assert "checkpoint" in statuses

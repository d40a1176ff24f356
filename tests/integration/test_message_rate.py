"""`global.max_message_rate` against a real nats-server and the services as processes: messages
over the rate are not dropped but read later, all of them, in log order, and no sooner than the
rate allows; an empty router database rebuilds the same pacing from the log, and a router
started under another rate rebuilds its projection as a replay under that rate would fold it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.request
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

from agentgrove import GroveClient, build_config
from grove_core.log import EventLog
from grove_core.projection import ProjectionStore
from grove_core.records import Recorded
from grove_events import MessageEvent, new_id
from grove_router.service import NAME, PROJECTION, Router
from tests.conftest import NatsEndpoint, StackFactory
from tests.integration.test_governance import wait_status
from tests.integration.test_log import spawn_event, status_event

pytestmark = pytest.mark.integration

RATE = 5
COUNT = 20
CONFIG = f"resources:\n  global:\n    max_message_rate: {RATE}\n"
RECEIVER = build_config("python", entrypoint="tests.governance_agents:receives")
#: Leeway for comparing the clocks of three processes on one machine (seconds).
CLOCK_LEEWAY_S = 0.01


@pytest.fixture
async def client(nats_server: NatsEndpoint) -> AsyncIterator[GroveClient]:
    async with await GroveClient.connect(nats_server.url) as grove:
        yield grove


async def messages(log: EventLog) -> list[tuple[MessageEvent, datetime]]:
    """Each message on the log, with when the log stored it."""
    return [
        (item.event, item.stored_at)
        async for item in log.events(1, subjects="grove.message.*")
        if isinstance(item, Recorded)
        and isinstance(item.event, MessageEvent)
        and item.stored_at is not None
    ]


async def inbox_entries(client: GroveClient, agent_id: str) -> list[dict[str, Any]]:
    """The router's rows of the agent's whole inbox, once it has folded the log to its tip."""
    request = {"agent_id": agent_id, "after": 0, "limit": 1000}
    answer = await client.routing.rpc(
        "inbox", {**request, "after_seq": await client.log.last_seq()}, timeout=30
    )
    entries: list[dict[str, Any]] = answer["entries"]
    return entries


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text: str = response.read().decode()
        return text


async def test_messages_over_the_rate_are_all_read_later_in_order(
    make_stack: StackFactory, client: GroveClient
) -> None:
    stack = await asyncio.to_thread(make_stack, config=CONFIG)
    agent = await client.spawn(str(COUNT), RECEIVER)
    await wait_status(client.log, agent, "started")
    for i in range(COUNT):
        await client.routing.send(f"m{i}", to=agent)

    result = await client.wait(agent, timeout=60)
    assert result.reason == "completed", result.error
    arrivals = json.loads(result.summary)
    assert [text for text, _ in arrivals] == [f"m{i}" for i in range(COUNT)]

    # A burst of RATE at once, then one every 1/RATE s: the i-th message cannot be read sooner
    # than (i - RATE + 1) / RATE s after the log stored the first one.
    sent = await messages(client.log)
    assert [m.content for m, _ in sent] == [f"m{i}" for i in range(COUNT)]
    first_sent = sent[0][1]
    for i, (_, read_at) in enumerate(arrivals):
        earliest = first_sent.timestamp() + max(0, i - RATE + 1) / RATE
        assert read_at >= earliest - CLOCK_LEEWAY_S, f"m{i} was read too soon"
    assert arrivals[-1][1] - first_sent.timestamp() >= (COUNT - RATE) / RATE - CLOCK_LEEWAY_S

    # The router gave each paced message its moment, and no message was read before it.
    entries = await inbox_entries(client, agent)
    assert [e["type"] for e in entries] == ["message"] * COUNT
    moments = [e["not_before"] for e in entries]
    paced = [m for m in moments if m is not None]
    assert len(paced) >= COUNT - 2 * RATE, "most messages should have been over the rate"
    for (_, read_at), moment in zip(arrivals, moments, strict=True):
        if moment is not None:
            assert read_at >= datetime.fromisoformat(moment).timestamp() - CLOCK_LEEWAY_S
    metrics = await asyncio.to_thread(scrape, stack.services["router"].http_port)
    assert f"grove_router_messages_paced_total {float(len(paced))}" in metrics

    # An empty router database rebuilds the same moments from the log.
    await asyncio.to_thread(stack.services["router"].stop)
    for suffix in ("", "-wal", "-shm"):
        (stack.data_dir / f"{NAME}.db{suffix}").unlink(missing_ok=True)
    await asyncio.to_thread(stack.restart, "router")
    assert [e["not_before"] for e in await inbox_entries(client, agent)] == moments


async def test_without_a_message_rate_nothing_is_held_back(
    make_stack: StackFactory, client: GroveClient
) -> None:
    await asyncio.to_thread(make_stack)
    agent = await client.spawn(str(COUNT), RECEIVER)
    await wait_status(client.log, agent, "started")
    for i in range(COUNT):
        await client.routing.send(f"m{i}", to=agent)
    result = await client.wait(agent, timeout=60)
    assert result.reason == "completed", result.error
    assert [text for text, _ in json.loads(result.summary)] == [f"m{i}" for i in range(COUNT)]
    assert [e["not_before"] for e in await inbox_entries(client, agent)] == [None] * COUNT


def fold_rebuilds() -> float:
    value = REGISTRY.get_sample_value(
        "grove_projection_rebuilds_total", {"projection": PROJECTION, "cause": "fold"}
    )
    return value or 0.0


async def router_moments(
    event_log: EventLog, store: ProjectionStore, rate: float | None, agent_id: str
) -> list[str | None]:
    """Run a router under `rate` until it has folded the log, stop it (its last write done),
    and give the `not_before` of each entry of the agent's inbox."""
    router = Router(event_log, store, message_rate=rate)
    running = asyncio.create_task(router.runner.run())
    try:
        await asyncio.wait_for(router.runner.caught_up.wait(), 10)
    finally:
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running
    return [entry.not_before for entry in router.state.inbox(agent_id)]


async def test_a_router_started_under_another_rate_folds_the_log_again(
    event_log: EventLog, tmp_path: Path
) -> None:
    """The rate decides each message's moment. A router resumed under a new rate would keep
    the moments the old one gave, which no replay of the log under the new rate gives."""
    await event_log.append(spawn_event("kid"))
    await event_log.append(status_event("kid", "started"))
    now = datetime.now(UTC)
    sender: dict[str, Any] = {"from": "caller"}
    await event_log.append_many(
        [
            MessageEvent(
                event_id=new_id(),
                agent_id="caller",
                timestamp=now,
                content=f"m{i}",
                to="kid",
                **sender,
            )
            for i in range(COUNT)
        ]
    )
    store = ProjectionStore(f"sqlite:///{tmp_path / 'router.db'}")
    try:
        before = fold_rebuilds()
        paced = await router_moments(event_log, store, RATE, "kid")
        assert len(paced) == COUNT
        assert sum(m is not None for m in paced) >= COUNT - 2 * RATE

        unpaced = await router_moments(event_log, store, None, "kid")
        assert unpaced == [None] * COUNT
        assert fold_rebuilds() == before + 1

        assert await router_moments(event_log, store, None, "kid") == unpaced
        assert await router_moments(event_log, store, RATE, "kid") == paced
        assert await router_moments(event_log, store, float(RATE), "kid") == paced
        assert fold_rebuilds() == before + 2  # the same rate, written either way, resumes
    finally:
        store.close()

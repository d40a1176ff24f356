"""The router against a real nats-server: what each subscription delivers, ordered and durable
inboxes across a router crash, message acknowledgement, ttl and priority, the router's queries,
and a rebuild from an empty database."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agentgrove import GroveClient, build_config
from agentgrove.routing import InboxItem, RouterError, Routing
from grove_core.log import EventLog
from grove_core.projection import ProjectionStore
from grove_events import (
    AgentConfig,
    SpawnEvent,
    StatusEvent,
    TerminateEvent,
    new_id,
)
from grove_router.service import NAME, Router
from tests.conftest import NatsEndpoint, StackFactory

pytestmark = pytest.mark.integration

SLEEPER = AgentConfig(runtime="command", command=["sleep", "60"])
READER = build_config("python", entrypoint="tests.routing_agents:reader")
DRAINER = build_config("python", entrypoint="tests.routing_agents:sleeps_then_drains")


@pytest.fixture
async def router(
    event_log: EventLog, nats_server: NatsEndpoint, tmp_path: Path
) -> AsyncIterator[Router]:
    """The router in this process, on its own database, answering queries."""
    store = ProjectionStore(f"sqlite:///{tmp_path / 'router.db'}")
    service = Router(event_log, store)
    task = asyncio.create_task(service.runner.run())
    await asyncio.wait_for(service.runner.caught_up.wait(), 20)
    await service.rpc.start(nats_server.url)
    try:
        yield service
    finally:
        await service.rpc.close()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        store.close()


@pytest.fixture
async def client(nats_server: NatsEndpoint) -> AsyncIterator[GroveClient]:
    async with await GroveClient.connect(nats_server.url) as grove:
        yield grove


async def append_spawn(log: EventLog, agent_id: str, parent: str | None = None, **kw: Any) -> None:
    await log.append(
        SpawnEvent(
            event_id=new_id(),
            agent_id=agent_id,
            parent=parent,
            task=f"task of {agent_id}",
            config=SLEEPER,
            **kw,
        )
    )


async def append_status(log: EventLog, agent_id: str, status_type: str, summary: str = "") -> None:
    await log.append(
        StatusEvent(
            event_id=new_id(),
            agent_id=agent_id,
            status_type=status_type,
            payload={"summary": summary},
        )
    )


async def inbox_of(routing: Routing, agent_id: str) -> list[InboxItem]:
    """The whole inbox, once the router has folded everything appended so far."""
    items, _ = await routing.inbox(agent_id, 0, limit=1000, fresh=True)
    return items


def shape(items: list[InboxItem]) -> list[tuple[str, str, str]]:
    return [(item.type, item.via, item.text) for item in items]


async def test_each_subscription_delivers_what_it_should_and_nothing_else(
    event_log: EventLog, router: Router
) -> None:
    routing = Routing(event_log, identity="caller")
    await append_spawn(event_log, "root")
    await append_spawn(event_log, "kid", parent="root")
    await append_spawn(event_log, "grandkid", parent="kid")
    await append_spawn(
        event_log,
        "watcher",
        subscriptions=["topic:news", "task:kid", "broadcast:all", "agent:kid"],
    )
    await append_spawn(event_log, "stranger")
    for agent in ("root", "kid", "grandkid", "watcher", "stranger"):
        await append_status(event_log, agent, "started")

    await Routing(event_log, identity="root").send("hello kid", to="kid")
    await Routing(event_log, identity="stranger").send("extra!", topic="news")
    await Routing(event_log, identity="stranger").send("everyone", topic="all")
    await Routing(event_log, identity="root").send("plans for my line", topic="plans")
    await append_status(event_log, "kid", "checkpoint", "halfway")
    await Routing(event_log, identity="grandkid").ask(
        "which way?", agent_path=["root", "kid", "grandkid"], tree_id="root"
    )
    await event_log.append(
        TerminateEvent(
            event_id=new_id(), agent_id="grandkid", reason="completed", result={"summary": "done"}
        )
    )
    await routing.inject("kid", "look here first")

    assert shape(await inbox_of(routing, "root")) == [("hitl", "subtree:kid", "which way?")]
    assert shape(await inbox_of(routing, "kid")) == [
        ("message", "agent:kid", "hello kid"),
        ("message", "lineage:kid", "plans for my line"),
        ("hitl", "subtree:grandkid", "which way?"),
        ("terminate", "subtree:grandkid", "done"),
        ("control", "agent:kid", "look here first"),
    ]
    assert shape(await inbox_of(routing, "grandkid")) == [
        ("message", "lineage:grandkid", "plans for my line"),
    ]
    assert shape(await inbox_of(routing, "watcher")) == [
        ("status", "task:kid", "status"),
        ("message", "agent:kid", "hello kid"),
        ("message", "topic:news", "extra!"),
        ("message", "broadcast:all", "everyone"),
        ("status", "task:kid", "halfway"),
        ("control", "agent:kid", "look here first"),
    ]
    assert await inbox_of(routing, "stranger") == []
    kid_items = await inbox_of(routing, "kid")
    assert (kid_items[2].source, kid_items[2].agent_path) == (
        "grandkid",
        ["root", "kid", "grandkid"],
    )
    assert kid_items[-1].injected


async def test_the_router_answers_queries_and_refuses_unknown_agents_clearly(
    event_log: EventLog, router: Router
) -> None:
    routing = Routing(event_log)
    await append_spawn(event_log, "root")
    await append_spawn(event_log, "kid", parent="root", subscriptions=["topic:x"])
    await append_status(event_log, "root", "started")
    summary = await routing.summary("kid")
    assert summary["agent_path"] == ["root", "kid"]
    assert summary["state"] == "spawning"
    assert summary["subscriptions"] == ["agent:kid", "lineage:kid", "topic:x"]
    hierarchy = await routing.hierarchy("kid")
    assert hierarchy["root"]["agent_id"] == "root"
    assert [c["agent_id"] for c in hierarchy["root"]["children"]] == ["kid"]
    rows = await routing.query("subscribers", {"subscription": "topic:x"})
    assert rows == [{"subscription": "topic:x", "agents": ["kid"]}]
    running = await routing.query("agents", {"state": "running"})
    assert [row["agent_id"] for row in running] == ["root"]
    with pytest.raises(RouterError, match="no agent 'nobody'"):
        await routing.summary("nobody")
    with pytest.raises(RouterError, match="unknown query type"):
        await routing.query("everything")


async def test_inbox_is_ordered_and_durable_across_a_router_kill(
    make_stack: StackFactory, client: GroveClient
) -> None:
    stack = await asyncio.to_thread(make_stack)
    count = 30
    agent = await client.spawn(str(count), READER)
    sender = Routing(client.log, identity="sender")
    for i in range(count):
        await sender.send(f"m{i:02d}", to=agent)
        if i == 10:
            await asyncio.to_thread(stack.services["router"].kill)
        if i == 20:
            await asyncio.to_thread(stack.restart, "router")
    result = await client.wait(agent, timeout=60)
    assert result.reason == "completed", result.error
    assert json.loads(result.summary) == [f"m{i:02d}" for i in range(count)]
    items = await inbox_of(client.routing, agent)
    assert [item.text for item in items] == [f"m{i:02d}" for i in range(count)]
    assert len({item.seq for item in items}) == count
    assert [item.index for item in items] == list(range(1, count + 1))
    summary = await client.routing.summary(agent)
    assert summary["inbox"]["committed"] == count


async def test_ack_ttl_and_priority(make_stack: StackFactory, client: GroveClient) -> None:
    await asyncio.to_thread(make_stack)
    agent = await client.spawn("drain", DRAINER)
    await wait_running(client, agent)
    await client.stop(agent)
    await client.wait(agent, timeout=20)
    # Sent while the agent is stopped: held, delivered when it runs again.
    await client.send("low", to=agent, priority=-3)
    await client.send("expires", to=agent, ttl=0.5)
    await client.send("high", to=agent, priority=7)
    acked = await client.send("please ack", to=agent, requires_ack=True, correlation_id="c-1")
    await client.send("middle", to=agent, ttl=300)
    await client.inject_message(agent, "injected: read first")
    await asyncio.sleep(1.0)  # the short ttl runs out before the agent starts again
    await client.resume(agent)
    ack = await client.routing.wait_ack(acked, timeout=30)
    assert (ack.from_, ack.to, ack.correlation_id) == (agent, "caller", "c-1")
    result = await wait_second_end(client, agent)
    assert json.loads(result.result.summary) == [
        "injected: read first",
        "high",
        "please ack",
        "middle",
        "low",
    ]


async def wait_running(client: GroveClient, agent_id: str, timeout: float = 20) -> None:
    async def started() -> None:
        async for item in client.log.events(1, subjects=f"grove.status.{agent_id}", follow=True):
            event = getattr(item, "event", None)
            if isinstance(event, StatusEvent) and event.status_type == "started":
                return

    await asyncio.wait_for(started(), timeout)


async def wait_second_end(client: GroveClient, agent_id: str) -> TerminateEvent:
    async def ends() -> TerminateEvent:
        seen = 0
        async for item in client.log.events(1, subjects=f"grove.terminate.{agent_id}", follow=True):
            event = getattr(item, "event", None)
            if isinstance(event, TerminateEvent):
                seen += 1
                if seen == 2:
                    return event
        raise AssertionError("the log ended")

    return await asyncio.wait_for(ends(), 40)


def router_rows(data_dir: Path) -> tuple[int, dict[str, dict[str, Any]]]:
    store = ProjectionStore(f"sqlite:///{data_dir / f'{NAME}.db'}")
    try:
        return store.load(NAME)
    finally:
        store.close()


async def test_an_empty_router_database_rebuilds_the_same_inboxes(
    make_stack: StackFactory, client: GroveClient
) -> None:
    stack = await asyncio.to_thread(make_stack)
    agent = await client.spawn("3", READER)
    watcher = await client.spawn("watch", SLEEPER, subscriptions=[f"task:{agent}", "topic:t"])
    for text in ("a", "b", "c"):
        await client.send(text, to=agent, priority=1)
    await client.send("news", topic="t")
    assert (await client.wait(agent, timeout=30)).reason == "completed"
    await client.stop(watcher)
    await client.wait(watcher, timeout=20)
    question = await Routing(client.log, identity=watcher).ask(
        "still there?", agent_path=[watcher], tree_id=watcher
    )
    assert [r["request_id"] for r in await client.pending()] == [question]
    tip = await client.log.last_seq()
    before_inbox = [i.seq for i in await inbox_of(client.routing, watcher)]
    assert before_inbox, "the watcher should have received its subscriptions' events"

    await asyncio.to_thread(stack.services["router"].stop)
    before = router_rows(stack.data_dir)
    for suffix in ("", "-wal", "-shm"):
        (stack.data_dir / f"{NAME}.db{suffix}").unlink(missing_ok=True)
    await asyncio.to_thread(stack.restart, "router")
    assert [i.seq for i in await inbox_of(client.routing, watcher)] == before_inbox
    assert [r["request_id"] for r in await client.pending()] == [question]
    await asyncio.to_thread(stack.services["router"].stop)
    after = router_rows(stack.data_dir)
    assert await client.log.last_seq() == tip
    assert after[0] == before[0] == tip
    assert after[1] == before[1]


async def test_messages_to_unknown_agents_are_refused(event_log: EventLog) -> None:
    with pytest.raises(LookupError, match="no agent 'ghost'"):
        await GroveClient(event_log).send("boo", to="ghost")


async def test_an_agent_queries_the_router_from_its_context(
    make_stack: StackFactory, client: GroveClient
) -> None:
    await asyncio.to_thread(make_stack)
    root = await client.spawn("60", SLEEPER)
    await wait_running(client, root)
    child = await client.spawn(
        "look around",
        build_config("python", entrypoint="tests.routing_agents:inspector"),
        parent=root,
    )
    result = await client.wait(child, timeout=30)
    assert result.reason == "completed", result.error
    assert json.loads(result.summary) == {
        "path": [root, child],
        "root_children": [child],
        "parent_state": "running",
        "my_state": "running",
        "tree_agents": sorted([root, child]),
    }
    await client.stop(root)

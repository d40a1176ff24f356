"""The router against a real nats-server: what each subscription delivers, ordered and durable
inboxes across a router crash, message acknowledgement, ttl and priority, the router's queries,
and a rebuild from an empty database."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agentgrove import GroveClient, build_config
from agentgrove.routing import (
    BEHIND_WAIT_S,
    ROUTER_TIMEOUT_S,
    InboxItem,
    RouterError,
    Routing,
    riding_out_restarts,
)
from grove_core.log import EventLog
from grove_core.projection import ProjectionStore
from grove_events import (
    AgentConfig,
    ControlEvent,
    HitlEvent,
    MessageEvent,
    SpawnEvent,
    StatusEvent,
    TerminateEvent,
    new_id,
)
from grove_router.service import NAME, QueryError, Router
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


async def test_a_wait_for_the_fold_is_answered_once_folded_and_refused_in_time_beyond_it(
    event_log: EventLog, router: Router
) -> None:
    await append_spawn(event_log, "waited")
    tip = await event_log.last_seq()
    await router.wait_applied(tip, 5)
    with pytest.raises(
        QueryError, match=rf"not folded the log to seq {tip + 1} within 0.2 s .*at seq {tip}\)"
    ):
        await router.wait_applied(tip + 1, 0.2)
    waiting = asyncio.create_task(router.wait_applied(tip + 1, 5))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    await append_status(event_log, "waited", "started")
    await waiting
    assert router.runner.applied_seq == tip + 1


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
    assert summary["task"] == "task of kid"
    await append_spawn(event_log, "done", parent="root")
    await append_status(event_log, "done", "checkpoint", "half way")
    await event_log.append(
        TerminateEvent(
            event_id=new_id(),
            agent_id="done",
            reason="completed",
            result={"summary": "all of it"},
            usage={"tokens": 42, "runtime_s": 1.5},
        )
    )
    await event_log.append(
        HitlEvent(
            event_id=new_id(),
            agent_id="kid",
            action="request",
            request_id="q-kid",
            agent_path=["root", "kid"],
            kind="question",
            prompt="which way?",
        )
    )
    done = await routing.summary("done")
    assert (done["state"], done["last_status"], done["summary"]) == (
        "completed",
        "checkpoint",
        "all of it",
    )
    assert done["usage"] == {"tokens": 42}
    kid = await routing.summary("kid")
    assert [q["request_id"] for q in kid["pending_questions"]] == ["q-kid"]
    root = await routing.summary("root")
    assert [(c["agent_id"], c["state"]) for c in root["children"]] == [
        ("kid", "spawning"),
        ("done", "completed"),
    ]
    hierarchy = await routing.hierarchy("kid")
    assert hierarchy["root"]["agent_id"] == "root"
    assert [c["agent_id"] for c in hierarchy["root"]["children"]] == ["kid", "done"]
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


async def test_a_query_lost_with_a_killed_router_is_asked_again_within_seconds(
    make_stack: StackFactory, client: GroveClient
) -> None:
    # A query that waits for the router's fold lets it wait `BEHIND_WAIT_S` at a time, so a
    # router that dies holding the query costs that and the query's margin, not the 25 s a
    # router far behind may take to fold.
    stack = await asyncio.to_thread(make_stack)
    agent = await client.spawn("5", READER)
    router = stack.services["router"]
    router.signal(signal.SIGSTOP)  # the next query waits, unread, in the router's socket
    asking = asyncio.create_task(riding_out_restarts(lambda: client.routing.summary(agent)))
    await asyncio.sleep(0.5)
    await asyncio.to_thread(router.kill)
    await asyncio.to_thread(stack.restart, "router")
    async with asyncio.timeout(BEHIND_WAIT_S + ROUTER_TIMEOUT_S + 5):
        summary = await asking
    assert summary["state"] in {"admitted", "running"}


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


# -- what each automatic and explicit subscription brings, one by one --------------------------


async def append_terminate(log: EventLog, agent_id: str, summary: str) -> None:
    await log.append(
        TerminateEvent(
            event_id=new_id(), agent_id=agent_id, reason="completed", result={"summary": summary}
        )
    )


async def test_a_child_spawned_without_subscribe_parent_does_not_reach_its_manager(
    event_log: EventLog, router: Router
) -> None:
    routing = Routing(event_log)
    await append_spawn(event_log, "manager")
    await append_spawn(event_log, "quiet", parent="manager", subscribe_parent=False)
    await append_spawn(event_log, "normal", parent="manager")
    for agent in ("manager", "quiet", "normal"):
        await append_status(event_log, agent, "started")
    await append_terminate(event_log, "quiet", "quiet is done")
    await append_terminate(event_log, "normal", "normal is done")

    assert shape(await inbox_of(routing, "manager")) == [
        ("terminate", "subtree:normal", "normal is done")
    ]
    subscriptions = (await routing.summary("manager"))["subscriptions"]
    assert subscriptions == ["agent:manager", "subtree:normal"]
    # The quiet child still hears its own line.
    assert (await routing.summary("quiet"))["subscriptions"] == ["agent:quiet", "lineage:quiet"]


async def test_a_task_subscription_brings_that_agent_s_statuses_and_end(
    event_log: EventLog, router: Router
) -> None:
    routing = Routing(event_log)
    await append_spawn(event_log, "worker")
    await append_spawn(event_log, "watcher", subscriptions=["task:worker"])
    await append_spawn(event_log, "bystander")
    for agent in ("watcher", "worker", "bystander"):
        await append_status(event_log, agent, "started")
    await append_status(event_log, "worker", "checkpoint", "halfway")
    await Routing(event_log, identity="bystander").send("for the worker only", to="worker")
    await append_status(event_log, "bystander", "checkpoint", "not watched")
    await append_terminate(event_log, "worker", "all done")

    watched = await inbox_of(routing, "watcher")
    assert shape(watched) == [
        ("status", "task:worker", "status"),
        ("status", "task:worker", "halfway"),
        ("terminate", "task:worker", "all done"),
    ]
    assert {item.source for item in watched} == {"worker"}
    assert await inbox_of(routing, "bystander") == []


async def test_a_lineage_subscription_brings_an_ancestor_s_end_to_its_descendants(
    event_log: EventLog, router: Router
) -> None:
    routing = Routing(event_log)
    await append_spawn(event_log, "root")
    await append_spawn(event_log, "mid", parent="root")
    await append_spawn(event_log, "leaf", parent="mid")
    await append_spawn(event_log, "other-root")
    await append_spawn(event_log, "other-leaf", parent="other-root")
    for agent in ("root", "mid", "leaf", "other-root", "other-leaf"):
        await append_status(event_log, agent, "started")
    await append_terminate(event_log, "root", "the root gave up")

    leaf = await inbox_of(routing, "leaf")
    assert shape(leaf) == [("terminate", "lineage:leaf", "the root gave up")]
    assert (leaf[0].source, leaf[0].agent_path) == ("root", ["root"])
    assert shape(await inbox_of(routing, "mid")) == [
        ("terminate", "lineage:mid", "the root gave up")
    ]
    assert await inbox_of(routing, "other-leaf") == []
    assert await inbox_of(routing, "other-root") == []


# -- ttl and priority for a running agent that reads late --------------------------------------

PHASED = "tests.messaging_agents:reads_in_phases"


def phased_reader(**spec: Any) -> tuple[str, AgentConfig]:
    return json.dumps(spec), build_config("python", entrypoint=PHASED)


async def wait_checkpoint(client: GroveClient, agent_id: str, summary: str) -> None:
    async def reported() -> None:
        async for item in client.log.events(1, subjects=f"grove.status.{agent_id}", follow=True):
            event = getattr(item, "event", None)
            if isinstance(event, StatusEvent) and event.payload.summary == summary:
                return

    await asyncio.wait_for(reported(), 30)


async def test_a_running_agent_that_reads_late_does_not_get_an_expired_message(
    make_stack: StackFactory, client: GroveClient
) -> None:
    await asyncio.to_thread(make_stack)
    task, config = phased_reader(phases=[[3, 0]], pause=2.0)
    agent = await client.spawn(task, config)
    await wait_running(client, agent)
    await client.send("short-lived", to=agent, ttl=1.0)
    await client.send("long-lived", to=agent, ttl=300)
    await client.send("no ttl", to=agent)

    result = await client.wait(agent, timeout=40)
    assert result.reason == "completed", result.error
    read = json.loads(result.summary)
    assert [text for _, _, text, _ in read["entries"]] == ["long-lived", "no ttl"]
    assert read["expired"] == 1
    # It was delivered while the agent ran (observers still see it); only the reader skips it.
    assert [item.text for item in await inbox_of(client.routing, agent)] == [
        "short-lived",
        "long-lived",
        "no ttl",
    ]


async def test_a_running_agent_reads_what_waits_by_priority_then_log_order(
    make_stack: StackFactory, client: GroveClient
) -> None:
    await asyncio.to_thread(make_stack)
    task, config = phased_reader(phases=[[4, 1], [5, 3]])
    agent = await client.spawn(task, config)
    await wait_running(client, agent)
    await client.send("low", to=agent, priority=-3)
    await client.send("first", to=agent)
    await client.send("high", to=agent, priority=7)
    await client.send("second", to=agent)
    # After its first read the agent holds three unread; a more urgent message then comes.
    await wait_checkpoint(client, agent, "phase 0")
    await client.send("urgent", to=agent, priority=9)

    result = await client.wait(agent, timeout=40)
    assert result.reason == "completed", result.error
    read = json.loads(result.summary)
    assert [text for _, _, text, _ in read["entries"]] == [
        "high",
        "urgent",
        "first",
        "second",
        "low",
    ]
    assert read["expired"] == 0


# -- messages between agents, through the agent API --------------------------------------------


async def test_an_agent_s_message_is_acknowledged_and_answered_in_its_thread(
    make_stack: StackFactory, client: GroveClient
) -> None:
    await asyncio.to_thread(make_stack)
    responder = await client.spawn(
        "answer one", build_config("python", entrypoint="tests.messaging_agents:responder")
    )
    requester = await client.spawn(
        json.dumps({"to": responder, "correlation_id": "thread-7"}),
        build_config("python", entrypoint="tests.messaging_agents:requester"),
    )
    asked = await client.wait(requester, timeout=40)
    assert asked.reason == "completed", asked.error
    answered = await client.wait(responder, timeout=40)
    assert answered.reason == "completed", answered.error

    got = json.loads(answered.summary)
    assert got == {
        "content": "ping",
        "from": requester,
        "correlation_id": "thread-7",
        "requires_ack": True,
    }
    seen = json.loads(asked.summary)
    sent = seen["sent"]
    assert seen["ack"] == {
        "from": responder,
        "to": requester,
        "ack_of": sent,
        "correlation_id": "thread-7",
        "causation_id": sent,
        "content": f"ack {sent}",
    }
    assert (seen["reply"]["from"], seen["reply"]["correlation_id"]) == (responder, "thread-7")
    assert seen["reply"]["ack_of"] is None
    messages = [
        item.event
        async for item in client.log.events(1, subjects="grove.message.*")
        if isinstance(getattr(item, "event", None), MessageEvent)
    ]
    original = next(m for m in messages if m.event_id == sent)
    assert (original.from_, original.to, original.requires_ack, original.correlation_id) == (
        requester,
        responder,
        True,
        "thread-7",
    )
    # Acknowledged once, by the recipient, in the same thread.
    assert [(m.from_, m.correlation_id) for m in messages if m.ack_of == sent] == [
        (responder, "thread-7")
    ]


async def test_an_agent_injects_a_message_into_its_child_s_context(
    make_stack: StackFactory, client: GroveClient
) -> None:
    await asyncio.to_thread(make_stack)
    parent = await client.spawn(
        "steer a child",
        build_config("python", entrypoint="tests.messaging_agents:injecting_parent"),
    )
    result = await client.wait(parent, timeout=60)
    assert result.reason == "completed", result.error
    outcome = json.loads(result.summary)
    child = outcome["child"]
    assert outcome["result"]["entries"] == [
        ["control", f"agent:{child}", "injected: read me first", True],
        ["message", f"agent:{child}", "plain message", False],
    ]
    injections = [
        item.event
        async for item in client.log.events(1, subjects=f"grove.control.{child}")
        if isinstance(getattr(item, "event", None), ControlEvent)
    ]
    assert [(e.action, e.issued_by) for e in injections] == [("inject_message", parent)]

"""Questions for a human and permissions, with the whole stack on a real nats-server: a
grandchild's question answered by the caller, an answer given while the asker is stopped,
clear errors for unknown and answered requests, permission intersection, approval, denial."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from agentgrove import GroveClient, build_config
from agentgrove.routing import AlreadyAnswered, UnknownRequest
from grove_core.records import Recorded
from grove_events import HitlEvent, StatusEvent, TerminateEvent, new_id
from tests.conftest import NatsEndpoint, StackFactory
from tests.integration.test_recovery import wait_metric

pytestmark = pytest.mark.integration


def agent(name: str, **options: Any) -> Any:
    return build_config("python", entrypoint=f"tests.routing_agents:{name}", **options)


@pytest.fixture
async def client(nats_server: NatsEndpoint) -> AsyncIterator[GroveClient]:
    async with await GroveClient.connect(nats_server.url) as grove:
        yield grove


async def next_request(client: GroveClient, tree_id: str, timeout: float = 30) -> dict[str, Any]:
    """The first request of a tree, as the caller watching its root sees it."""

    async def first() -> str:
        async with contextlib.aclosing(client.routing.requests(tree_id)) as requests:
            async for event in requests:
                return event.request_id
        raise AssertionError("the log ended")

    request_id = await asyncio.wait_for(first(), timeout)
    return await client.routing.request(request_id)


async def ends(
    client: GroveClient, agent_id: str, count: int, timeout: float = 40
) -> TerminateEvent:
    """The agent's `count`-th terminate."""

    async def nth() -> TerminateEvent:
        seen = 0
        async for item in client.log.events(1, subjects=f"grove.terminate.{agent_id}", follow=True):
            if isinstance(item, Recorded) and isinstance(item.event, TerminateEvent):
                seen += 1
                if seen == count:
                    return item.event
        raise AssertionError("the log ended")

    return await asyncio.wait_for(nth(), timeout)


async def test_a_grandchild_s_question_is_answered_by_the_caller_and_reaches_only_it(
    make_stack: StackFactory, client: GroveClient
) -> None:
    stack = await asyncio.to_thread(make_stack)
    root = await client.spawn("which way to the sea?", agent("top"))
    request = await next_request(client, root)
    root_summary = await client.routing.summary(root)
    middle = root_summary["children"][0]["agent_id"]
    grandchild = (await client.routing.summary(middle))["children"][0]["agent_id"]
    assert request["agent_path"] == [root, middle, grandchild]
    assert request["agent_id"] == grandchild
    assert request["kind"] == "question"
    assert request["options"] == ["left", "right"]
    assert request["summary"] == "which way to the sea?"
    assert [r["request_id"] for r in await client.pending(root)] == [request["request_id"]]
    assert [
        q["request_id"] for q in (await client.routing.summary(grandchild))["pending_questions"]
    ] == [request["request_id"]]

    # A router restart loses no pending request.
    await asyncio.to_thread(stack.services["router"].kill)
    await asyncio.to_thread(stack.restart, "router")
    assert [r["request_id"] for r in await client.pending(root)] == [request["request_id"]]

    await client.answer(request["request_id"], "left")
    result = await client.wait(root, timeout=40)
    assert (result.reason, result.summary) == ("completed", "answer: left")
    assert await client.pending(root) == []

    def hitl_kinds(items: list[Any]) -> list[str]:
        return [item.event.action for item in items if isinstance(item.event, HitlEvent)]

    inboxes = {
        name: (await client.routing.inbox(agent_id, 0, limit=1000, fresh=True))[0]
        for name, agent_id in (("root", root), ("middle", middle), ("grandchild", grandchild))
    }
    assert hitl_kinds(inboxes["grandchild"]) == ["response"]
    assert hitl_kinds(inboxes["middle"]) == ["request"]
    assert hitl_kinds(inboxes["root"]) == ["request"]
    # The parent's inbox holds its child's result, not the grandchild's.
    terminates = [i.source for i in inboxes["root"] if i.type == "terminate"]
    assert terminates == [middle]


async def test_an_answer_given_while_the_asker_is_stopped_reaches_it_when_it_resumes(
    make_stack: StackFactory, client: GroveClient
) -> None:
    await asyncio.to_thread(make_stack)
    asker = await client.spawn("left or right?", agent("asker"))
    request = await next_request(client, asker)
    await client.stop(asker)
    assert (await ends(client, asker, 1)).reason == "stopped"
    await client.answer(request["request_id"], "right")
    await client.resume(asker)
    resumed = await ends(client, asker, 2)
    assert (resumed.reason, resumed.result.summary) == ("completed", "answer: right")
    asked = await client.routing.query("hitl", {"agent_id": asker})
    assert [row["request_id"] for row in asked] == [request["request_id"]]


async def test_unknown_and_answered_requests_are_clear_errors(
    make_stack: StackFactory, client: GroveClient
) -> None:
    await asyncio.to_thread(make_stack)
    with pytest.raises(UnknownRequest, match="no HITL request 'nope'"):
        await client.answer("nope", "yes")
    asker = await client.spawn("once?", agent("asker"))
    request = await next_request(client, asker)
    await client.answer(request["request_id"], "left")
    with pytest.raises(AlreadyAnswered, match="already answered by caller: 'left'"):
        await client.answer(request["request_id"], "right")
    assert (await client.wait(asker, timeout=30)).summary == "answer: left"


async def test_an_agent_of_another_tree_cannot_answer_a_question(
    make_stack: StackFactory, client: GroveClient
) -> None:
    stack = await asyncio.to_thread(make_stack)
    asker = await client.spawn("once?", agent("asker"))
    stranger = await client.spawn("30", build_config("python", entrypoint="tests.agents:sleeper"))
    request = await next_request(client, asker)
    intruder = GroveClient(client.log, identity=stranger)

    with pytest.raises(PermissionError, match=f"cannot answer request {request['request_id']}"):
        await intruder.answer(request["request_id"], "from outside")
    forged = HitlEvent(
        event_id=new_id(),
        agent_id=asker,
        action="response",
        request_id=request["request_id"],
        answer="forged",
        by=stranger,
    )
    await client.log.append(forged)  # straight to the log: the router does not take it
    # ... and records why: a metric, and a line in its log.
    router = stack.services["router"]
    async with aiohttp.ClientSession() as session, asyncio.timeout(20):
        await wait_metric(session, router.http_port, "grove_router_refused_events_total", 1)
    router_log = stack.data_dir / "logs" / "router.log"
    assert f"may not answer a question of tree {asker}" in router_log.read_text()
    assert (await client.routing.request(request["request_id"]))["pending"]
    await client.answer(request["request_id"], "left")
    assert (await client.wait(asker, timeout=30)).summary == "answer: left"
    await client.stop(stranger)


async def test_a_child_s_permissions_are_its_parent_s_intersected_with_its_own(
    make_stack: StackFactory, client: GroveClient
) -> None:
    await asyncio.to_thread(make_stack)
    parent = await client.spawn(
        "limit", agent("parent_of_limited", permissions=["spawn", "fs.read"])
    )
    result = await client.wait(parent, timeout=40)
    assert result.reason == "completed", result.error
    assert json.loads(result.summary) == {"spawn": False, "fs.read": True, "net": False}
    root = await client.spawn("spawn,shell", agent("capabilities"))
    assert json.loads((await client.wait(root, timeout=30)).summary) == {
        "spawn": True,
        "shell": True,
    }


async def test_a_permission_request_approved_and_one_denied(
    make_stack: StackFactory, client: GroveClient
) -> None:
    await asyncio.to_thread(make_stack)
    approved = await client.spawn("shell", agent("needs_capability", permissions=["fs.read"]))
    request = await next_request(client, approved)
    assert (request["kind"], request["capability"]) == ("permission", "shell")
    await client.answer(request["request_id"], "approve")
    assert (await client.wait(approved, timeout=30)).summary == "granted shell"
    summary = await client.routing.summary(approved)
    assert summary["permissions"] == ["fs.read"]
    assert summary["granted"] == ["shell"]

    denied = await client.spawn("net", agent("needs_capability", permissions=[]))
    request = await next_request(client, denied)
    await client.answer(request["request_id"], "deny")
    result = await client.wait(denied, timeout=30)
    assert result.summary.startswith(f"denied: agent {denied} may not use 'net'")
    assert (await client.routing.summary(denied))["granted"] == []


async def test_spawning_without_the_spawn_capability_asks_first(
    make_stack: StackFactory, client: GroveClient
) -> None:
    await asyncio.to_thread(make_stack)
    parent = await client.spawn("ask me", agent("top", permissions=["fs.read"]))
    request = await next_request(client, parent)
    assert (request["kind"], request["capability"], request["agent_id"]) == (
        "permission",
        "spawn",
        parent,
    )
    statuses = [
        item.event.status_type
        async for item in client.log.events(1, subjects=f"grove.status.{parent}")
        if isinstance(item, Recorded) and isinstance(item.event, StatusEvent)
    ]
    assert "completed" not in statuses
    await client.answer(request["request_id"], "deny")
    result = await client.wait(parent, timeout=30)
    assert result.reason == "failed"
    assert "may not use 'spawn'" in (result.error or "")


def grove(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run `grove ARGS` against the test's server."""
    env = {k: v for k, v in os.environ.items() if k not in ("GROVE_NATS_URL", "GROVE_DATA_DIR")}
    return subprocess.run(
        [sys.executable, "-m", "agentgrove.cli", "--nats-url", url, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("grove: error: ")
    return lines[0]


async def test_the_cli_lists_answers_shows_and_sends(
    make_stack: StackFactory, client: GroveClient, nats_server: NatsEndpoint
) -> None:
    await asyncio.to_thread(make_stack)
    url = nats_server.url
    asker = await client.spawn("left or right, from the cli?", agent("asker"))
    request = await next_request(client, asker)
    request_id = request["request_id"]

    listed = await asyncio.to_thread(grove, url, "pending", "--tree", asker)
    assert listed.returncode == 0, listed.stderr
    assert request_id in listed.stdout
    assert "left or right, from the cli?" in listed.stdout
    shown = await asyncio.to_thread(grove, url, "show", asker)
    assert shown.returncode == 0, shown.stderr
    assert f"agent {asker}: running" in shown.stdout
    assert f"open question {request_id}" in shown.stdout

    answered = await asyncio.to_thread(grove, url, "answer", request_id, "right")
    assert answered.returncode == 0, answered.stderr
    assert f"answered {request_id} for agent {asker}" in answered.stdout
    again = await asyncio.to_thread(grove, url, "answer", request_id, "left")
    assert "already answered" in one_line_error(again)
    unknown = await asyncio.to_thread(grove, url, "answer", "no-such-request", "left")
    assert "no HITL request 'no-such-request'" in one_line_error(unknown)
    assert (await client.wait(asker, timeout=30)).summary == "answer: right"

    reader = await client.spawn("1", agent("reader"))
    sent = await asyncio.to_thread(
        grove, url, "send", "from the shell", "--to", reader, "--wait-ack", "30"
    )
    assert sent.returncode == 0, sent.stderr
    assert (await client.wait(reader, timeout=30)).summary == '["from the shell"]'
    inbox = await asyncio.to_thread(grove, url, "inbox", reader)
    assert inbox.returncode == 0, inbox.stderr
    assert "message   from caller" in inbox.stdout
    assert "via agent:" in inbox.stdout
    ghost = await asyncio.to_thread(grove, url, "send", "boo", "--to", "ghost")
    assert "no agent 'ghost'" in one_line_error(ghost)


# -- capabilities enforced by the control plane ------------------------------------------------


def scripted(*steps: str, **options: Any) -> tuple[str, Any]:
    """The task and config of a `tests.messaging_agents:scripted` agent running `steps`."""
    config = build_config("python", entrypoint="tests.messaging_agents:scripted", **options)
    return json.dumps(list(steps)), config


def spawn_refused(agent_id: str, holds: str) -> str:
    return (
        f"refused: parent {agent_id} does not hold the 'spawn' permission (it holds: {holds}); "
        "it must ask for 'spawn' (a permission request) and have it approved before spawning"
    )


async def answer_next(
    client: GroveClient, agent_id: str, answer: str, timeout: float = 30
) -> dict[str, Any]:
    """Answer the agent's next open request as it is asked; returns the request."""

    async def asked() -> dict[str, Any]:
        while True:
            pending = await client.routing.pending(agent_id=agent_id)
            if pending:
                return pending[0]
            await asyncio.sleep(0.1)

    asking = asyncio.ensure_future(asked())
    ending = asyncio.ensure_future(client.wait(agent_id))
    try:
        await asyncio.wait({asking, ending}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (asking, ending):
            task.cancel()
    if not asking.cancelled() and asking.done():
        request = asking.result()
    elif not ending.cancelled() and ending.done():
        pytest.fail(f"agent {agent_id} ended before it asked: {ending.result()}")
    else:
        pytest.fail(f"agent {agent_id} asked nothing within {timeout:g} s")
    await client.answer(request["request_id"], answer)
    return request


async def test_the_governor_rejects_a_spawn_whose_parent_lacks_spawn_until_it_is_granted(
    make_stack: StackFactory, client: GroveClient
) -> None:
    stack = await asyncio.to_thread(make_stack)
    task, config = scripted("spawn", "ask:spawn", "spawn", permissions=["fs.read"])
    agent_id = await client.spawn(task, config)
    request = await answer_next(client, agent_id, "approve")
    assert (request["kind"], request["capability"]) == ("permission", "spawn")
    result = await client.wait(agent_id, timeout=60)
    assert result.reason == "completed", result.error
    before, asked, after = json.loads(result.summary)
    assert before == ["rejected", spawn_refused(agent_id, "fs.read")]
    assert asked == "granted"
    assert after == ["completed", "child done"]
    children = (await client.routing.summary(agent_id))["children"]
    assert [child["state"] for child in children] == ["rejected", "completed"]

    # The decisions are a fold of the log: a governor rebuilt from an empty database comes to
    # the same ones and has nothing to append.
    tip = await client.log.last_seq()
    await asyncio.to_thread(stack.services["governor"].stop)
    for suffix in ("", "-wal", "-shm"):
        (stack.data_dir / f"governor.db{suffix}").unlink(missing_ok=True)
    await asyncio.to_thread(stack.restart, "governor")
    for child in children:
        status = await client.resource_status(child["agent_id"])
        assert status["self"]["phase"] == "ended"
    await asyncio.sleep(1.0)  # a few of the governor's ticks
    assert await client.log.last_seq() == tip


async def test_a_granted_capability_is_for_the_asking_agent_alone(
    make_stack: StackFactory, client: GroveClient
) -> None:
    await asyncio.to_thread(make_stack)
    parent = await client.spawn(
        "60",
        build_config("python", entrypoint="tests.agents:sleeper", permissions=["spawn", "fs.read"]),
    )
    # The sibling runs before the grant and checks after it (when told to go on).
    task, config = scripted("read", "holds:shell", "holds:spawn", "spawn", permissions=["fs.read"])
    sibling = await client.spawn(task, config, parent=parent)
    task, config = scripted(
        "ask:shell", "ask:spawn", "holds:shell", "spawn", permissions=["fs.read"]
    )
    asker = await client.spawn(task, config, parent=parent)
    for capability in ("shell", "spawn"):
        request = await answer_next(client, asker, "approve")
        assert request["capability"] == capability
    result = await client.wait(asker, timeout=60)
    assert result.reason == "completed", result.error
    assert json.loads(result.summary) == ["granted", "granted", True, ["completed", "child done"]]

    await client.send("go on", to=sibling)
    result = await client.wait(sibling, timeout=60)
    assert result.reason == "completed", result.error
    assert json.loads(result.summary) == [
        "go on",
        False,
        False,
        ["rejected", spawn_refused(sibling, "fs.read")],
    ]
    assert await client.routing.permissions(parent) == (["fs.read", "spawn"], [])
    assert await client.routing.permissions(sibling) == (["fs.read"], [])
    assert await client.routing.permissions(asker) == (["fs.read"], ["shell", "spawn"])
    await client.stop(parent)

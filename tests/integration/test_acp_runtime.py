"""The `acp` runtime on a running stack with an ACP agent written with the same library:
initialize, new session, prompt; session updates as checkpoints; permission requests allowed
by held capabilities or asked up the tree; files and terminals served within permissions and
the workspace; cancel on stop; the session loaded on resume."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from acp.schema import PermissionOption

from agentgrove import GroveClient, build_config
from grove_core.records import Recorded
from grove_events import AgentConfig, StatusEvent, TerminateEvent
from grove_spawner.acp_runtime import choose_option
from tests.conftest import StackFactory

pytestmark = pytest.mark.integration

ACP_COMMAND = [
    sys.executable,
    "-c",
    "from tests.task_agents import acp_agent_main; acp_agent_main()",
]
AGENT = build_config("acp", command=ACP_COMMAND)


def holding(*capabilities: str) -> AgentConfig:
    return build_config("acp", command=ACP_COMMAND, permissions=list(capabilities))


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    root = tmp_path / "workspace"
    root.mkdir()
    (root / "notes.txt").write_text("first\nsecond\nthird\n")
    (tmp_path / "secret.txt").write_text("not for agents")
    return root


@pytest.fixture
async def client(
    make_stack: StackFactory, tmp_path: Path, workspace: Path
) -> AsyncIterator[GroveClient]:
    stack = make_stack(GROVE_TEST_MARK=str(tmp_path / "cancelled"), GROVE_WORKSPACE=str(workspace))
    async with await GroveClient.connect(stack.url) as grove:
        yield grove


async def question_of(client: GroveClient, agent: str) -> dict[str, Any]:
    """The agent's pending HITL request, as the caller sees it."""

    async def find() -> dict[str, Any]:
        while True:
            for request in await client.pending():
                if request.get("agent_id") == agent:
                    return request
            await asyncio.sleep(0.1)

    return await asyncio.wait_for(find(), 30)


async def tool_call_seen(client: GroveClient, agent: str, timeout: float = 30) -> None:
    """Wait until the agent has reported a tool call (it is inside its prompt turn)."""

    async def seen() -> None:
        async for item in client.log.events(1, subjects=f"grove.status.{agent}", follow=True):
            if isinstance(item, Recorded) and "tool call" in getattr(
                getattr(item.event, "payload", None), "summary", ""
            ):
                return

    await asyncio.wait_for(seen(), timeout)


async def checkpoints(client: GroveClient, agent: str) -> list[str]:
    return [
        item.event.payload.summary
        async for item in client.log.events(1, subjects=f"grove.status.{agent}")
        if isinstance(item, Recorded)
        and isinstance(item.event, StatusEvent)
        and item.event.status_type == "checkpoint"
    ]


async def test_a_prompt_turn_with_its_updates_as_checkpoints(client: GroveClient) -> None:
    agent = await client.spawn("tidy up", AGENT)
    result = await client.wait(agent, timeout=60)
    assert (result.reason, result.summary) == ("completed", "did: tidy up; permission: no question")
    assert result.tokens == 50
    seen = await checkpoints(client, agent)
    assert seen[:2] == ["plan: read the brief (pending)", "tool call: look around"]
    assert "50 tokens used" in seen


async def test_a_permission_request_becomes_a_question_up_the_tree(client: GroveClient) -> None:
    agent = await client.spawn("ask first", AGENT)

    async def question() -> dict[str, str]:
        while True:
            for request in await client.pending():
                if request.get("agent_id") == agent or agent in request.get("agent_path", []):
                    return request
            await asyncio.sleep(0.1)

    request = await asyncio.wait_for(question(), 30)
    assert request["prompt"] == f"agent {agent} asks permission: delete the cache"
    assert request["options"] == ["allow", "reject"]
    await client.answer(request["request_id"], "approve")
    result = await client.wait(agent, timeout=60)
    assert result.summary == "did: ask first; permission: go"


async def test_a_stop_cancels_the_prompt_turn(client: GroveClient, tmp_path: Path) -> None:
    agent = await client.spawn("hang on", AGENT)

    await tool_call_seen(client, agent)
    await client.stop(agent, "enough")
    assert (await client.wait(agent, timeout=30)).reason == "stopped"
    mark = tmp_path / "cancelled"
    for _ in range(100):
        if mark.exists():
            break
        await asyncio.sleep(0.05)
    assert mark.read_text() == "cancelled"


async def test_a_held_capability_allows_a_tool_call_without_asking(client: GroveClient) -> None:
    agent = await client.spawn("perm-read", holding("fs.read"))
    result = await client.wait(agent, timeout=60)
    assert result.summary == "did: perm-read; permission: go"
    assert await client.routing.query("hitl", {"agent_id": agent}) == []


async def test_a_capability_not_held_is_asked_for_up_the_tree(client: GroveClient) -> None:
    approved = await client.spawn("perm-delete", holding("fs.read"))
    request = await question_of(client, approved)
    assert (request["kind"], request["capability"]) == ("permission", "fs.write")
    assert request["prompt"].endswith("'fs.write': delete the notes")
    await client.answer(request["request_id"], "approve")
    assert (await client.wait(approved, timeout=60)).summary == ("did: perm-delete; permission: go")

    denied = await client.spawn("perm-delete", holding("fs.read"))
    await client.answer((await question_of(client, denied))["request_id"], "deny")
    assert (await client.wait(denied, timeout=60)).summary == "did: perm-delete; permission: stop"


async def test_files_are_served_within_the_permissions_and_the_workspace(
    client: GroveClient, workspace: Path
) -> None:
    reader = await client.spawn("files", holding("fs.read"))
    result = await client.wait(reader, timeout=60)
    offered, read, wrote, outside = json.loads(result.summary.split("permission: ", 1)[1])
    assert offered == "offered read=True write=False"
    assert read == "read 'second\\n'"
    assert wrote.startswith("refused -32003")
    assert "does not hold 'fs.write'" in wrote
    assert outside.startswith("refused -32602")
    assert "outside the agent's workspace" in outside
    assert not (workspace / "out").exists()

    writer = await client.spawn("files", holding("fs.read", "fs.write"))
    result = await client.wait(writer, timeout=60)
    offered, _, wrote, _ = json.loads(result.summary.split("permission: ", 1)[1])
    assert offered == "offered read=True write=True"
    assert not wrote.startswith("refused")
    assert (workspace / "out" / "w.txt").read_text() == "hi"


async def test_terminals_are_served_only_with_shell(client: GroveClient) -> None:
    shell = await client.spawn("shell", holding("shell"))
    result = await client.wait(shell, timeout=60)
    code, output, truncated, released = json.loads(result.summary.split("permission: ", 1)[1])
    assert (code, output, truncated, released) == (3, "two\n", True, True)

    no_shell = await client.spawn("shell", holding("fs.read"))
    said = (await client.wait(no_shell, timeout=60)).summary
    assert "no terminal offered; refused -32003" in said
    assert "does not hold 'shell'" in said


async def test_a_resumed_agent_loads_its_acp_session(client: GroveClient) -> None:
    agent = await client.spawn("hang on", AGENT)

    await tool_call_seen(client, agent)
    await client.stop(agent, "later")
    assert (await client.wait(agent, timeout=30)).reason == "stopped"
    await client.resume(agent, "go on")

    async def second_end() -> TerminateEvent:
        ends = 0
        async for item in client.log.events(1, subjects=f"grove.terminate.{agent}", follow=True):
            if isinstance(item, Recorded) and isinstance(item.event, TerminateEvent):
                ends += 1
                if ends == 2:
                    return item.event
        raise AssertionError("the log ended")

    resumed = await asyncio.wait_for(second_end(), 60)
    # The loaded session's replayed history is not taken for the answer.
    assert resumed.result.summary == "did: go on; permission: no question; earlier: hang on"
    seen = await checkpoints(client, agent)
    assert any(s.startswith("ACP session acp-") and s.endswith(" loaded") for s in seen)


def test_answers_pick_permission_options() -> None:
    options = [
        PermissionOption(option_id="go", name="Allow once", kind="allow_once"),
        PermissionOption(option_id="never", name="Reject", kind="reject_always"),
    ]
    assert choose_option("allow once", options) == "go"
    assert choose_option("never", options) == "never"
    assert choose_option("yes", options) == "go"
    assert choose_option("maybe", options) is None

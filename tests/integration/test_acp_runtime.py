"""The `acp` runtime on a running stack with an ACP agent written with the same library:
initialize, new session, prompt; session updates as checkpoints; a permission request as a
HITL question; cancel on stop."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from acp.schema import PermissionOption

from agentgrove import GroveClient, build_config
from grove_core.log import Recorded
from grove_events import StatusEvent
from grove_spawner.acp_runtime import choose_option
from tests.conftest import StackFactory

pytestmark = pytest.mark.integration

AGENT = build_config(
    "acp",
    command=[
        sys.executable,
        "-c",
        "from tests.task_agents import acp_agent_main; acp_agent_main()",
    ],
)


@pytest.fixture
async def client(make_stack: StackFactory, tmp_path: Path) -> AsyncIterator[GroveClient]:
    stack = make_stack(GROVE_TEST_MARK=str(tmp_path / "cancelled"))
    async with await GroveClient.connect(stack.url) as grove:
        yield grove


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

    async def tool_call_seen() -> None:
        async for item in client.log.events(1, subjects=f"grove.status.{agent}", follow=True):
            if isinstance(item, Recorded) and "tool call" in getattr(
                getattr(item.event, "payload", None), "summary", ""
            ):
                return

    await asyncio.wait_for(tool_call_seen(), 30)
    await client.stop(agent, "enough")
    assert (await client.wait(agent, timeout=30)).reason == "stopped"
    mark = tmp_path / "cancelled"
    for _ in range(100):
        if mark.exists():
            break
        await asyncio.sleep(0.05)
    assert mark.read_text() == "cancelled"


def test_answers_pick_permission_options() -> None:
    options = [
        PermissionOption(option_id="go", name="Allow once", kind="allow_once"),
        PermissionOption(option_id="never", name="Reject", kind="reject_always"),
    ]
    assert choose_option("allow once", options) == "go"
    assert choose_option("never", options) == "never"
    assert choose_option("yes", options) == "go"
    assert choose_option("maybe", options) is None

"""The `task` tool (AgentContext.delegate) on a running stack: validation, a child's report,
the incomplete notice for a child that is stopped or fails, the return budget, concurrency,
and the built-in profiles."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agentgrove import GroveClient, build_config
from grove_core.log import EventLog
from grove_core.records import Recorded
from grove_events import StatusEvent, TerminateEvent
from tests.conftest import NatsEndpoint, StackFactory

pytestmark = pytest.mark.integration

PROFILES = """
profiles:
  - name: meeter
    description: waits for a sibling
    entrypoint: tests.task_agents:rendezvous
  - name: echo
    description: repeats its brief
    entrypoint: tests.task_agents:echo
    return_budget: 40
  - name: idler
    description: works until stopped
    entrypoint: tests.task_agents:waits_to_be_stopped
  - name: failer
    description: always fails
    entrypoint: tests.lifecycle_agents:fails
"""


@pytest.fixture
async def client(nats_server: NatsEndpoint) -> AsyncIterator[GroveClient]:
    async with await GroveClient.connect(nats_server.url) as grove:
        yield grove


async def run_delegator(client: GroveClient, calls: list[dict[str, str]]) -> list[dict[str, Any]]:
    parent = await client.spawn(
        json.dumps(calls), build_config("python", entrypoint="tests.task_agents:delegator")
    )
    result = await client.wait(parent, timeout=60)
    assert result.reason == "completed", result.error
    results: list[dict[str, Any]] = json.loads(result.summary)
    return results


async def first_status(
    log: EventLog, agent_id: str, status_type: str, timeout: float = 30
) -> StatusEvent:
    async def seen() -> StatusEvent:
        async for item in log.events(1, subjects=f"grove.status.{agent_id}", follow=True):
            if (
                isinstance(item, Recorded)
                and isinstance(item.event, StatusEvent)
                and item.event.status_type == status_type
            ):
                return item.event
        raise AssertionError("log ended")

    return await asyncio.wait_for(seen(), timeout)


async def test_bad_arguments_and_unknown_types_are_refused(
    make_stack: StackFactory, client: GroveClient
) -> None:
    make_stack(config=PROFILES)
    agent = await client.spawn(
        "check", build_config("python", entrypoint="tests.task_agents:validates")
    )
    result = await client.wait(agent, timeout=60)
    errors = json.loads(result.summary)
    assert (
        errors[0]
        == "ValueError: task description must be 1 to 120 characters (a short label), not 0"
    )
    assert errors[1].endswith("not 121")
    assert errors[2].startswith("ValueError: task prompt must be 1 to 100000 characters")
    assert errors[3].endswith("not 100001")
    assert errors[4] == (
        "UnknownSubagentType: unknown subagent_type 'astrologer'; available: echo, explore, "
        "failer, idler, meeter, reasoning (more are defined under `profiles:` in the config file)"
    )


async def test_a_childs_report_within_its_budget(
    make_stack: StackFactory, client: GroveClient
) -> None:
    make_stack(config=PROFILES)
    brief = "say this back: " + "x" * 100
    [report] = await run_delegator(
        client, [{"description": "echo it", "prompt": brief, "subagent_type": "echo"}]
    )
    assert report["subagent_type"] == "echo"
    assert report["content"] == brief[:40]
    assert "stop" not in report
    child_end = await client.wait(report["session_id"], timeout=5)
    assert child_end.truncated
    parent_spawn = await client._origin(report["session_id"])
    assert parent_spawn is not None
    assert report["parent_session_id"] == parent_spawn.parent


async def test_two_tasks_run_at_the_same_time(
    make_stack: StackFactory, client: GroveClient, tmp_path: Path
) -> None:
    make_stack(config=PROFILES)
    marks = tmp_path / "marks"
    marks.mkdir()
    call = {"description": "meet", "prompt": str(marks), "subagent_type": "meeter"}
    reports = await run_delegator(client, [call, call])
    assert [r["content"] for r in reports] == ["met 1 sibling", "met 1 sibling"]
    assert len({r["session_id"] for r in reports}) == 2


async def test_a_stopped_child_gives_an_incomplete_report(
    make_stack: StackFactory, client: GroveClient
) -> None:
    make_stack(config=PROFILES)
    parent = await client.spawn(
        json.dumps([{"description": "idle", "prompt": "idle", "subagent_type": "idler"}]),
        build_config("python", entrypoint="tests.task_agents:delegator"),
    )
    delegated = await first_status(client.log, parent, "checkpoint")
    child = delegated.payload.details["child"]
    assert delegated.payload.summary == "task idler: idle"
    await first_status(client.log, child, "checkpoint")
    await client.stop(child, "enough")
    result = await client.wait(parent, timeout=30)
    [report] = json.loads(result.summary)
    assert report["stop"] == {"reason": "stopped"}
    assert report["content"].startswith(
        "[incomplete report: the subagent was stopped; what follows is all it returned]"
    )
    assert report["content"].endswith("enough")


async def test_a_failed_child_gives_an_incomplete_report_with_its_error(
    make_stack: StackFactory, client: GroveClient
) -> None:
    make_stack(config=PROFILES)
    [report] = await run_delegator(
        client, [{"description": "try", "prompt": "open the door", "subagent_type": "failer"}]
    )
    assert report["stop"] == {
        "reason": "failed",
        "error": "RuntimeError: the door is locked",
    }
    assert report["content"] == (
        "[incomplete report: the subagent failed; what follows is all it returned]\n"
        "error: RuntimeError: the door is locked"
    )


async def test_stopping_the_parent_stops_the_child_it_waits_for(
    make_stack: StackFactory, client: GroveClient
) -> None:
    make_stack(config=PROFILES)
    parent = await client.spawn(
        json.dumps([{"description": "idle", "prompt": "idle", "subagent_type": "idler"}]),
        build_config("python", entrypoint="tests.task_agents:delegator"),
    )
    child = (await first_status(client.log, parent, "checkpoint")).payload.details["child"]
    await first_status(client.log, child, "checkpoint")
    await client.stop(parent)
    assert (await client.wait(parent, timeout=30)).reason == "stopped"
    assert (await client.wait(child, timeout=30)).reason == "stopped"


async def test_the_builtin_profiles_work_offline(
    make_stack: StackFactory, client: GroveClient, tmp_path: Path
) -> None:
    make_stack()
    workspace = tmp_path / "repo"
    (workspace / "lib").mkdir(parents=True)
    (workspace / "lib" / "cache.py").write_text("class LruCache:\n    capacity = 128\n")
    (workspace / "README.md").write_text("Nothing to see.\n")
    explore_report, reasoning_report = await run_delegator(
        client,
        [
            {
                "description": "find the cache",
                "prompt": f"Where is the LruCache capacity set?\nworkspace: {workspace}",
                "subagent_type": "explore",
            },
            {
                "description": "check the sums",
                "prompt": "We need 3 servers. Each costs 40 * 12 per year. Is that affordable?",
                "subagent_type": "reasoning",
            },
        ],
    )
    assert "- lib/cache.py:1: class LruCache:" in explore_report["content"]
    assert "- lib/cache.py:2: capacity = 128" in explore_report["content"]
    assert "40 * 12 = 480" in reasoning_report["content"]
    assert "- Is that affordable?" in reasoning_report["content"]
    child = await client._origin(explore_report["session_id"])
    assert child is not None
    assert child.config.profile == "explore"
    assert child.config.permissions == ["fs.read"]
    assert child.initial_context is not None
    assert child.initial_context.startswith("You explore a workspace read-only")
    end = await client.log.wait_for(f"grove.terminate.{explore_report['session_id']}", 5)
    assert isinstance(end.event, TerminateEvent)
    assert end.event.reason == "completed"

"""The `openai` runtime on a running stack, driven by a local fake OpenAI-compatible server: a
multi-step tool loop that spawns children, usage reported, the key kept out of the log,
max_iterations, and resume and fork going on with the conversation."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import aiohttp
import pytest

from agentgrove import GroveClient, SubAgentDefinition, build_config
from agentgrove.context import SessionEntry, check_entry_kind
from grove_core.config import GroveConfig
from grove_core.records import Recorded
from grove_events import StatusEvent
from grove_spawner.openai_runtime import EndpointError, conversation, resolve_endpoint
from tests.conftest import StackFactory
from tests.fake_openai import REFUSING_MODEL, TOKENS_PER_CALL, FakeOpenAI

pytestmark = pytest.mark.integration

SECRET = "sk-test-do-not-leak-4711"
MODEL = build_config("openai", model="fake-model")
ECHO = {"runtime": "python", "entrypoint": "tests.task_agents:echo"}


@pytest.fixture
async def fake() -> AsyncIterator[FakeOpenAI]:
    server = await FakeOpenAI().start()
    try:
        yield server
    finally:
        await server.close()


@pytest.fixture
async def client(make_stack: StackFactory, fake: FakeOpenAI) -> AsyncIterator[GroveClient]:
    stack = make_stack(
        config="profiles:\n  - name: looper\n    description: never done\n"
        "    runtime: openai\n    model: fake-model\n    max_iterations: 3\n",
        OPENAI_BASE_URL=fake.base_url,
        OPENAI_API_KEY=SECRET,
    )
    async with await GroveClient.connect(stack.url) as grove:
        yield grove


def script(*steps: dict[str, Any], loop: bool = False) -> str:
    return json.dumps({"steps": list(steps), "loop": loop})


def calls(*pairs: tuple[str, dict[str, Any]]) -> dict[str, Any]:
    return {"calls": [{"name": name, "arguments": args} for name, args in pairs]}


async def statuses(client: GroveClient, agent_id: str) -> list[StatusEvent]:
    return [
        item.event
        async for item in client.log.events(1, subjects=f"grove.status.{agent_id}")
        if isinstance(item, Recorded) and isinstance(item.event, StatusEvent)
    ]


async def test_a_tool_loop_spawns_children_and_reports_usage(
    client: GroveClient, fake: FakeOpenAI
) -> None:
    task = script(
        calls(
            ("spawn_agent", {"task": "child one", **ECHO}),
            ("spawn_agent", {"task": "child two", **ECHO}),
        ),
        calls(
            ("wait", {"agent_id": "$tool.0.agent_id"}), ("wait", {"agent_id": "$tool.1.agent_id"})
        ),
        calls(("get_resource_status", {})),
        {"content": "children said: $tool.2.summary / $tool.3.summary"},
    )
    agent = await client.spawn(task, MODEL)
    result = await client.wait(agent, timeout=60)
    assert (result.reason, result.summary) == ("completed", "children said: child one / child two")
    assert result.tokens == 4 * TOKENS_PER_CALL

    usage = [
        s.payload.details["tokens"]
        for s in await statuses(client, agent)
        if s.status_type == "checkpoint" and "tokens" in s.payload.details
    ]
    assert usage == [TOKENS_PER_CALL * n for n in range(1, 5)]

    requests = fake.conversations_of(task)
    assert len(requests) == 4
    last = requests[-1]
    status = json.loads(last[-1]["content"])
    assert status["self"]["agent_id"] == agent
    assert status["global"]["agents_running"] >= 1
    tool_names = {t["function"]["name"] for t in fake.requests[0]["tools"]}
    assert {"spawn_agent", "fork_agent", "task", "wait", "stop_agent", "get_resource_status"} <= (
        tool_names
    )
    assert set(fake.authorizations) == {f"Bearer {SECRET}"}

    async for record in client.log.read(1):
        assert SECRET.encode() not in record.data


async def test_the_key_stays_out_of_the_log_service_logs_and_metrics(
    make_stack: StackFactory, fake: FakeOpenAI
) -> None:
    stack = make_stack(name="leaky", OPENAI_BASE_URL=fake.base_url, OPENAI_API_KEY=SECRET)
    async with await GroveClient.connect(stack.url) as grove:
        refused = await grove.spawn("hello", build_config("openai", model=REFUSING_MODEL))
        failure = await grove.wait(refused, timeout=60)
        assert failure.reason == "failed"
        assert "refused credentials Bearer ***" in (failure.error or "")
        agent = await grove.spawn(script({"content": "hi"}), MODEL)
        assert (await grove.wait(agent, timeout=60)).summary == "hi"
        async for record in grove.log.read(1):
            assert SECRET.encode() not in record.data
    for log_file in (stack.data_dir / "logs").iterdir():
        assert SECRET not in log_file.read_text(errors="replace"), log_file.name
    async with aiohttp.ClientSession() as session:
        for service in stack.services.values():
            url = f"http://127.0.0.1:{service.http_port}/metrics"
            async with session.get(url) as response:
                exported = await response.text()
            assert "grove_" in exported, service.name
            assert SECRET not in exported, service.name


async def test_max_iterations_stops_the_run_and_says_so(client: GroveClient) -> None:
    looping = script(calls(("get_resource_status", {})), loop=True)
    agent = await client.spawn(looping, build_config("openai", profile="looper"))
    result = await client.wait(agent, timeout=60)
    assert result.reason == "failed"
    assert result.error == (
        "stopped at max_iterations=3: the model made 3 calls without a final answer"
    )
    assert result.tokens == 3 * TOKENS_PER_CALL
    failed = [s for s in await statuses(client, agent) if s.status_type == "failed"]
    assert failed[-1].payload.details["attempted"] == ["get_resource_status({})"] * 3


async def test_the_task_tool_delegates_from_a_model(client: GroveClient, fake: FakeOpenAI) -> None:
    task = script(
        calls(
            (
                "task",
                {
                    "description": "analyse",
                    "prompt": "It costs 6 * 7. Why?",
                    "subagent_type": "reasoning",
                },
            ),
            ("task", {"description": "bad", "prompt": "x", "subagent_type": "oracle"}),
        ),
        {"content": "done"},
    )
    agent = await client.spawn(task, MODEL)
    assert (await client.wait(agent, timeout=60)).summary == "done"
    [_, final] = fake.conversations_of(task)
    report, refused = (json.loads(m["content"]) for m in final if m["role"] == "tool")
    assert report["subagent_type"] == "reasoning"
    assert "6 * 7 = 42" in report["content"]
    assert refused["error"].startswith("unknown subagent_type 'oracle'; available: explore, looper")


async def test_resume_and_fork_go_on_with_the_conversation(
    client: GroveClient, fake: FakeOpenAI
) -> None:
    task = script(calls(("get_resource_status", {})), {"content": "first answer"})
    agent = await client.spawn(task, MODEL)
    assert (await client.wait(agent, timeout=60)).summary == "first answer"

    await client.resume(agent, "and now?")
    second = await asyncio.wait_for(_next_end(client, agent, after=1), 60)
    assert second == "finished after 2 steps; last user message: and now?"
    resumed = fake.conversations_of(task)[-1]
    assert [m["role"] for m in resumed] == ["user", "assistant", "tool", "assistant", "user"]
    assert resumed[1]["tool_calls"][0]["function"]["name"] == "get_resource_status"
    assert resumed[3]["content"] == "first answer"

    fork = await client.fork(agent, "try another way", initial_message="fork says hi")
    forked = await client.wait(fork, timeout=60)
    assert forked.summary == "finished after 3 steps; last user message: fork says hi"
    fork_request = fake.conversations_of(task)[-1]
    assert fork_request[-2]["role"] == "system"
    assert "You are a fork of agent" in fork_request[-2]["content"]
    assert [m["role"] for m in fork_request[:6]] == [
        "user",
        "assistant",
        "tool",
        "assistant",
        "user",
        "assistant",
    ]


async def _next_end(client: GroveClient, agent: str, after: int) -> str:
    """The summary of the agent's terminate after its first `after` ones."""
    seen = 0
    async for item in client.log.events(1, subjects=f"grove.terminate.{agent}", follow=True):
        if isinstance(item, Recorded):
            seen += 1
            if seen > after:
                return str(getattr(item.event, "result").summary)  # noqa: B009
    raise AssertionError("log ended")


async def test_without_an_endpoint_the_run_fails_saying_what_to_set(
    make_stack: StackFactory,
) -> None:
    stack = make_stack(name="bare", OPENAI_BASE_URL="", OPENAI_API_KEY="")
    async with await GroveClient.connect(stack.url) as grove:
        agent = await grove.spawn("hello", MODEL)
        result = await grove.wait(agent, timeout=60)
    assert result.reason == "failed"
    assert (result.error or "").startswith("runtime 'openai' needs an API key: set OPENAI_API_KEY")


def entry(kind: str, content: object) -> SessionEntry:
    text = content if isinstance(content, str) else json.dumps(content)
    return SessionEntry(check_entry_kind(kind), text, datetime(2026, 1, 1, tzinfo=UTC))


def test_a_session_becomes_the_conversation() -> None:
    call = {"id": "c1", "name": "wait", "arguments": '{"agent_id": "a"}'}
    entries = [
        entry("system", "be brief"),
        entry("user", "the task"),
        entry("assistant", "let me look"),
        entry("tool_call", call),
        entry("tool_call", {"id": "c2", "name": "get_resource_status", "arguments": "{}"}),
        entry("tool_call", {"tool": "ask_human", "request_id": "r1", "prompt": "ok?"}),
        entry("tool_result", {"tool": "ask_human", "request_id": "r1", "answer": "yes"}),
        entry("tool_result", {"id": "c1", "name": "wait", "content": '{"summary": "x"}'}),
        entry("user", "resumed: go on"),
    ]
    messages = conversation(entries)
    assert [m["role"] for m in messages] == [
        "system",
        "user",
        "assistant",
        "tool",
        "tool",
        "user",
    ]
    assert messages[2]["content"] == "let me look"
    assert [c["id"] for c in messages[2]["tool_calls"]] == ["c1", "c2"]
    assert messages[3] == {"role": "tool", "tool_call_id": "c1", "content": '{"summary": "x"}'}
    assert messages[4]["tool_call_id"] == "c2"
    assert "interrupted" in messages[4]["content"]


def test_where_the_endpoint_comes_from() -> None:
    environ = {"OPENAI_BASE_URL": "http://env/v1", "OPENAI_API_KEY": "k-env", "OPENAI_MODEL": "m"}
    plain = resolve_endpoint(GroveConfig(), None, None, environ)
    assert (plain.base_url, plain.api_key, plain.model, plain.max_iterations) == (
        "http://env/v1",
        "k-env",
        "m",
        20,
    )
    config = GroveConfig.model_validate(
        {"openai": {"base_url": "http://file/v1", "api_key": "k-file", "model": "mf"}}
    )
    profile = SubAgentDefinition(
        name="p", description="d", runtime="openai", model="mp", max_iterations=4
    )
    chosen = resolve_endpoint(config, profile, "ms", environ)
    assert (chosen.base_url, chosen.api_key, chosen.model, chosen.max_iterations) == (
        "http://file/v1",
        "k-file",
        "ms",
        4,
    )
    assert "k-file" not in repr(chosen)
    assert resolve_endpoint(config, profile, None, {}).model == "mp"
    with pytest.raises(EndpointError, match="needs a model"):
        resolve_endpoint(GroveConfig(), None, None, {"OPENAI_API_KEY": "k"})
    keyless = resolve_endpoint(GroveConfig(), None, "m", {"OPENAI_BASE_URL": "http://local/v1"})
    assert keyless.api_key == "unused"

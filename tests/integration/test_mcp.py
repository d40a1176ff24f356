"""`grove mcp` on a running stack, through the `mcp` client library over stdio: the tools an
agent gets, spawning and waiting on a child as that agent, the task tool and its refusals,
and a command agent that runs `grove mcp` as itself from the environment it is given."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from mcp import ClientSession, stdio_client

from agentgrove import GroveClient, build_config
from agentgrove.stack import Stack
from grove_core.auth import USERS
from grove_events import SpawnEvent
from tests.conftest import StackFactory
from tests.task_agents import grove_mcp_server, mcp_tool

pytestmark = pytest.mark.integration

ROOT = Path(__file__).parent.parent.parent


@pytest.fixture
def stack(make_stack: StackFactory) -> Stack:
    return make_stack(
        config="profiles:\n  - name: echo\n    description: repeats its brief\n"
        "    entrypoint: tests.task_agents:echo\n"
    )


@pytest.fixture
async def client(stack: Stack) -> AsyncIterator[GroveClient]:
    async with await GroveClient.connect(stack.url) as grove:
        yield grove


def server_env(stack: Stack) -> dict[str, str]:
    assert stack.config_file is not None
    return {
        **os.environ,
        "GROVE_NATS_URL": stack.url,
        "GROVE_CONFIG_FILE": str(stack.config_file),
        "PYTHONPATH": str(ROOT),
    }


async def spawn_of(client: GroveClient, agent_id: str) -> SpawnEvent:
    recorded = await client.log.wait_for(f"grove.spawn.{agent_id}", 5)
    assert isinstance(recorded.event, SpawnEvent)
    return recorded.event


async def test_an_mcp_client_manages_children_as_the_agent(
    stack: Stack, client: GroveClient
) -> None:
    manager = await client.spawn(
        "manage", build_config("python", entrypoint="tests.task_agents:waits_to_be_stopped")
    )
    env = server_env(stack)
    async with (
        stdio_client(grove_mcp_server(env, "--agent-id", manager)) as (read, write),
        ClientSession(read, write) as session,
    ):
        info = await session.initialize()
        assert info.instructions is not None
        assert manager in info.instructions
        tools = {tool.name: tool for tool in (await session.list_tools()).tools}
        assert {"spawn_agent", "fork_agent", "task", "wait", "stop_agent", "send_message"} <= set(
            tools
        )
        assert {"get_resource_status", "read_inbox", "ask_human", "query_index"} <= set(tools)
        assert {"put_artifact", "get_artifact", "list_artifacts"} <= set(tools)
        assert "- echo: repeats its brief" in (tools["task"].description or "")
        assert tools["wait"].input_schema["required"] == ["agent_id"]

        child = await mcp_tool(
            session,
            "spawn_agent",
            {"task": "hi there", "runtime": "python", "entrypoint": "tests.task_agents:echo"},
        )
        ended = await mcp_tool(session, "wait", {"agent_id": child["agent_id"], "timeout": 30})
        assert (ended["reason"], ended["summary"]) == ("completed", "hi there")
        assert (await spawn_of(client, child["agent_id"])).parent == manager

        report = await mcp_tool(
            session, "task", {"description": "echo", "prompt": "ping", "subagent_type": "echo"}
        )
        assert (report["content"], report["subagent_type"]) == ("ping", "echo")
        assert (await spawn_of(client, report["session_id"])).parent == manager

        refused = await mcp_tool(
            session, "task", {"description": "", "prompt": "ping", "subagent_type": "echo"}
        )
        assert refused["error"].startswith(
            "Error executing tool task: task description must be 1 to 120 characters"
        )
        unknown = await mcp_tool(
            session, "task", {"description": "x", "prompt": "ping", "subagent_type": "poet"}
        )
        assert "available: echo, explore, reasoning" in unknown["error"]

        stored = await mcp_tool(
            session, "put_artifact", {"name": "notes.md", "content": "# findings\nall good"}
        )
        assert (stored["agent_id"], stored["size"]) == (manager, 19)
        read_back = await mcp_tool(session, "get_artifact", {"artifact_id": stored["artifact_id"]})
        assert (read_back["text"], read_back["truncated"]) == ("# findings\nall good", False)
        # The index may fold the new artifact just after the put answered.
        for _ in range(100):
            listed = await mcp_tool(session, "list_artifacts", {})
            if listed["artifacts"]:
                break
            await asyncio.sleep(0.1)
        assert [a["name"] for a in listed["artifacts"]] == ["notes.md"]
        missing = await mcp_tool(session, "get_artifact", {"artifact_id": "nothing-here"})
        assert missing["error"].startswith("Error executing tool get_artifact:")

        status = await mcp_tool(session, "get_resource_status", {})
        assert status["self"]["agent_id"] == manager
        assert "capacity" in status["global"]

        await mcp_tool(session, "stop_agent", {"agent_id": manager, "reason": "done"})
    assert (await client.wait(manager, timeout=30)).reason == "stopped"


async def test_a_command_agent_runs_grove_mcp_as_itself(client: GroveClient) -> None:
    command = [
        sys.executable,
        "-c",
        "from tests.task_agents import command_agent_main; command_agent_main()",
    ]
    agent = await client.spawn("use grove mcp", build_config("command", command=command))
    result = await client.wait(agent, timeout=60)
    assert result.reason == "completed", result.error
    seen = json.loads(result.summary)
    assert (seen["me"], seen["tree"], seen["nats_url_given"]) == (agent, agent, True)
    assert seen["child_said"] == "hello from a command agent"
    assert (await spawn_of(client, seen["child"])).parent == agent


async def test_grove_mcp_refuses_an_unknown_agent(stack: Stack) -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "agentgrove.cli",
        "mcp",
        "--agent-id",
        "nobody",
        env=server_env(stack),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 1
    assert out == b""
    assert err.decode().startswith("grove: error: no agent 'nobody' in the log")


async def test_under_auth_a_command_agent_connects_with_the_spawners_credentials(
    tmp_path: Path,
) -> None:
    # Passwords that start with a letter: nats-server reads an environment value that starts
    # with a digit as a number, and a random one sometimes does.
    data_dir = tmp_path / "secured"
    (data_dir / "auth").mkdir(parents=True)
    (data_dir / "auth" / "passwords.json").write_text(
        json.dumps({user: f"pw{secrets.token_hex(16)}" for user in USERS})
    )
    secured = Stack(data_dir, auth=True, extra_env={"PYTHONPATH": str(ROOT)}).start()
    try:
        async with await GroveClient.connect(secured.caller_url) as grove:
            command = [
                sys.executable,
                "-c",
                "from tests.task_agents import command_agent_main; command_agent_main()",
            ]
            agent = await grove.spawn("use grove mcp", build_config("command", command=command))
            result = await grove.wait(agent, timeout=60)
            assert result.reason == "completed", result.error
            seen = json.loads(result.summary)
            assert seen["child_said"] == "hello from a command agent"
            assert (await spawn_of(grove, seen["child"])).parent == agent
    finally:
        secured.stop()

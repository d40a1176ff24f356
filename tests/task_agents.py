"""Python agents for the tests of the `task` tool, the openai runtime and `grove mcp`, run as
`tests.task_agents:<function>`."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from acp import (
    InitializeResponse,
    LoadSessionResponse,
    NewSessionResponse,
    PromptResponse,
    RequestError,
    plan_entry,
    run_agent,
    start_tool_call,
    update_agent_message_text,
    update_plan,
    update_user_message_text,
)
from acp.schema import AgentCapabilities, PermissionOption, ToolCallUpdate, Usage
from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp.types import TextContent

from agentgrove.context import AgentContext

#: How long a rendezvous waits for its sibling before giving up.
RENDEZVOUS_TIMEOUT_S = 30.0


async def delegator(ctx: AgentContext) -> str:
    """Runs the `task` calls of its task (`[{"description", "prompt", "subagent_type"}...]`)
    together and returns their results as a JSON list."""
    calls = json.loads(ctx.task)
    results = await asyncio.gather(
        *(ctx.delegate(c["description"], c["prompt"], c["subagent_type"]) for c in calls)
    )
    return json.dumps([r.model_dump(exclude_none=True) for r in results])


async def validates(ctx: AgentContext) -> str:
    """Makes `task` calls that must be refused; returns each error as `Type: message`."""
    errors = []
    for description, prompt, kind in [
        ("", "p", "reasoning"),
        ("d" * 121, "p", "reasoning"),
        ("d", "", "reasoning"),
        ("d", "p" * 100_001, "reasoning"),
        ("d", "p", "astrologer"),
    ]:
        try:
            await ctx.delegate(description, prompt, kind)
        except (ValueError, LookupError) as exc:
            errors.append(f"{exc.__class__.__name__}: {exc}")
    return json.dumps(errors)


async def rendezvous(ctx: AgentContext) -> str:
    """Leaves its mark in the folder of its task and waits until two marks are there: it ends
    only when a sibling runs at the same time."""
    folder = Path(ctx.task.strip())
    await asyncio.to_thread((folder / ctx.agent_id).write_text, str(time.time()))
    deadline = time.monotonic() + RENDEZVOUS_TIMEOUT_S
    while (marks := await asyncio.to_thread(_count, folder)) < 2:
        if time.monotonic() > deadline:
            raise TimeoutError("no sibling ran at the same time")
        await asyncio.sleep(0.05)
    return f"met {marks - 1} sibling"


def _count(folder: Path) -> int:
    return len(list(folder.iterdir()))


async def echo(ctx: AgentContext) -> str:
    """Returns its task."""
    return ctx.task


async def waits_to_be_stopped(ctx: AgentContext) -> str:
    """Says it is working, then waits until it is stopped."""
    await ctx.checkpoint("working on it")
    await asyncio.sleep(120)
    return "never"


def grove_mcp_server(env: dict[str, str], *extra: str) -> StdioServerParameters:
    """`grove mcp` as a stdio server process, with `env` (stdio children get a trimmed one)."""
    return StdioServerParameters(
        command=sys.executable, args=["-m", "agentgrove.cli", "mcp", *extra], env=env
    )


async def mcp_tool(session: ClientSession, name: str, arguments: dict[str, Any]) -> Any:
    """Call a tool; its JSON result, or `{"error": text}` when the server says it failed."""
    result = await session.call_tool(name, arguments)
    block = result.content[0]
    assert isinstance(block, TextContent)
    return {"error": block.text} if result.is_error else json.loads(block.text)


async def command_agent_over_mcp() -> dict[str, Any]:
    """What a CLI agent does with `grove mcp`: run it as itself (its environment, as the
    command runtime gives it), spawn a child through it and wait for the child."""
    env = dict(os.environ)
    async with (
        stdio_client(grove_mcp_server(env)) as (read, write),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        child = await mcp_tool(
            session,
            "spawn_agent",
            {
                "task": "hello from a command agent",
                "runtime": "python",
                "entrypoint": f"{__name__}:echo",
            },
        )
        ended = await mcp_tool(session, "wait", {"agent_id": child["agent_id"], "timeout": 60})
    return {
        "me": env.get("GROVE_AGENT_ID"),
        "tree": env.get("GROVE_TREE_ID"),
        "nats_url_given": bool(env.get("GROVE_NATS_URL")),
        "child": child["agent_id"],
        "child_said": ended["summary"],
    }


def command_agent_main() -> None:
    """The entry point of the command agent above: prints its findings as JSON."""
    print(json.dumps(asyncio.run(command_agent_over_mcp())))


class ScriptedAcpAgent:
    """An ACP agent for the acp runtime's tests. Its prompt says what to do: it always sends
    a plan and a tool call; with `ask` it asks permission to delete the cache (a tool call of
    no kind); with `perm-read` / `perm-delete` it asks for a `read` / `delete` tool call; with
    `files` it reads and writes files through the client; with `shell` it runs a command in a
    terminal; with `hang` it waits until cancelled and leaves a mark in the file named by
    GROVE_TEST_MARK. It keeps each session's prompts in a file beside that mark, so a later
    process can load the session (and replays it when loaded)."""

    def __init__(self) -> None:
        self.conn: Any = None
        self.cancelled = asyncio.Event()
        self.capabilities: Any = None
        self.earlier: list[str] = []

    def on_connect(self, conn: Any) -> None:
        self.conn = conn

    @staticmethod
    def _sessions(session_id: str) -> Path:
        return Path(os.environ["GROVE_TEST_MARK"]).parent / f"{session_id}.json"

    async def initialize(
        self, protocol_version: int, client_capabilities: Any = None, **kwargs: Any
    ) -> InitializeResponse:
        self.capabilities = client_capabilities
        return InitializeResponse(
            protocol_version=protocol_version,
            agent_capabilities=AgentCapabilities(load_session=True),
        )

    async def new_session(self, cwd: str, **kwargs: Any) -> NewSessionResponse:
        session_id = f"acp-{os.getpid()}"
        self._sessions(session_id).write_text("[]")
        return NewSessionResponse(session_id=session_id)

    async def load_session(self, cwd: str, session_id: str, **kwargs: Any) -> LoadSessionResponse:
        self.earlier = json.loads(self._sessions(session_id).read_text())
        for text in self.earlier:  # the history, replayed as ACP says
            await self.conn.session_update(session_id, update_user_message_text(text))
            await self.conn.session_update(session_id, update_agent_message_text(f"(on {text})"))
        return LoadSessionResponse()

    async def _permission(self, session_id: str, title: str, kind: str | None = None) -> str:
        options = [
            PermissionOption(option_id="go", name="allow", kind="allow_once"),
            PermissionOption(option_id="stop", name="reject", kind="reject_once"),
        ]
        response = await self.conn.request_permission(
            session_id, ToolCallUpdate(tool_call_id="t2", title=title, kind=kind), options
        )
        outcome = response.outcome
        return str(getattr(outcome, "option_id", None) or outcome.outcome)

    async def _try(self, call: Any) -> str:
        try:
            return str(await call)
        except RequestError as exc:
            return f"refused {exc.code}: {json.dumps(exc.data, sort_keys=True)}"

    async def _read(self, session_id: str, path: str, **options: Any) -> str:
        response = await self.conn.read_text_file(session_id, path, **options)
        return f"read {response.content!r}"

    async def _files(self, session_id: str) -> str:
        here = os.getcwd()
        fs = self.capabilities.fs
        offered = f"offered read={fs.read_text_file} write={fs.write_text_file}"
        read = await self._try(self._read(session_id, f"{here}/notes.txt", line=2, limit=1))
        wrote = await self._try(self.conn.write_text_file(session_id, f"{here}/out/w.txt", "hi"))
        outside = await self._try(self._read(session_id, f"{here}/../secret.txt"))
        return json.dumps([offered, read, wrote, outside])

    async def _shell(self, session_id: str) -> str:
        if not self.capabilities.terminal:
            refused = await self._try(self.conn.create_terminal(session_id, "true"))
            return f"no terminal offered; {refused}"
        created = await self.conn.create_terminal(
            session_id, "sh", args=["-c", "echo one; echo two; exit 3"], output_byte_limit=4
        )
        exited = await self.conn.wait_for_terminal_exit(session_id, created.terminal_id)
        output = await self.conn.terminal_output(session_id, created.terminal_id)
        await self.conn.release_terminal(session_id, created.terminal_id)
        gone = await self._try(self.conn.terminal_output(session_id, created.terminal_id))
        return json.dumps(
            [exited.exit_code, output.output, output.truncated, gone.startswith("refused")]
        )

    async def prompt(self, session_id: str, prompt: list[Any], **kwargs: Any) -> PromptResponse:
        text = " ".join(getattr(block, "text", "") for block in prompt)
        path = self._sessions(session_id)
        path.write_text(json.dumps([*json.loads(path.read_text()), text]))
        await self.conn.session_update(session_id, update_plan([plan_entry("read the brief")]))
        await self.conn.session_update(
            session_id, start_tool_call("t1", "look around", kind="read")
        )
        said = "no question"
        if "ask" in text:
            said = await self._permission(session_id, "delete the cache")
        if "perm-read" in text:
            said = await self._permission(session_id, "read the notes", kind="read")
        if "perm-delete" in text:
            said = await self._permission(session_id, "delete the notes", kind="delete")
        if "files" in text:
            said = await self._files(session_id)
        if "shell" in text:
            said = await self._shell(session_id)
        if "hang" in text:
            await self.cancelled.wait()
            mark = os.environ["GROVE_TEST_MARK"]
            await asyncio.to_thread(Path(mark).write_text, "cancelled")
            return PromptResponse(stop_reason="cancelled")
        earlier = f"; earlier: {' | '.join(self.earlier)}" if self.earlier else ""
        await self.conn.session_update(
            session_id, update_agent_message_text(f"did: {text}; permission: {said}{earlier}")
        )
        return PromptResponse(
            stop_reason="end_turn", usage=Usage(total_tokens=50, input_tokens=30, output_tokens=20)
        )

    async def cancel(self, session_id: str, **kwargs: Any) -> None:
        self.cancelled.set()


def acp_agent_main() -> None:
    """Run the scripted ACP agent on stdin/stdout."""
    asyncio.run(run_agent(ScriptedAcpAgent()))

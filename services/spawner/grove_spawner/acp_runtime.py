"""The `acp` runtime: an Agent Client Protocol agent over stdio (`config.command`).

The spawner is the ACP client: it starts the agent's process, initializes it, opens a session
and sends one prompt (the task, or the message a resumed or forked instance starts with). The
agent's session updates become `checkpoint` statuses (its plan, its tool calls and how they
end); the text it answers with is the result, recorded as an `assistant` entry.

Its permission requests are checked against the agent's permissions: a tool call whose kind
needs a capability the agent holds (`read` and `search`: `fs.read`; `edit`, `delete`, `move`:
`fs.write`; `execute`: `shell`; `fetch`: `net`) is allowed without asking; one it does not
hold becomes a `permission` HITL request for that capability up the tree (approved: allowed,
and granted from then on; denied: rejected). A tool call of another kind becomes a question
whose options are the request's own. Files and terminals are served within the agent's
permissions and workspace (see `grove_spawner.acp_host`).

A stop sends `session/cancel`, then the process is closed (stdin, then SIGTERM, then SIGKILL).
The ACP session's id is kept in the agent's session (a `system` entry); a resumed instance
asks the agent to load it (`session/load`) when the agent supports that, and otherwise opens
a new session and prompts it with the task and the resume message.

The process gets the same environment as a `command` agent (GROVE_AGENT_ID, GROVE_NATS_URL,
the agent NATS credentials of the spawner's settings), so it can run `grove mcp` as itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

from acp import (
    PROTOCOL_VERSION,
    RequestError,
    RequestPermissionResponse,
    spawn_agent_process,
    text_block,
)
from acp.schema import (
    AgentMessageChunk,
    AgentPlanUpdate,
    AgentThoughtChunk,
    AllowedOutcome,
    DeniedOutcome,
    Implementation,
    PermissionOption,
    ToolCallProgress,
    ToolCallStart,
    ToolCallUpdate,
    UserMessageChunk,
)

from agentgrove.context import AgentContext, SessionEntry
from agentgrove.routing import PermissionDenied
from grove_spawner.acp_host import AcpHost, tool_capability
from grove_spawner.runtimes import AgentRun, Outcome, process_environment

#: Seconds a cancelled agent gets to hear `session/cancel` before its process is closed.
CANCEL_GRACE_S = 2.0
#: Answers to a permission question that pick the first allowing option.
APPROVALS = frozenset({"approve", "approved", "allow", "allowed", "yes", "grant", "ok"})
#: How much of a plan or tool call title goes into a checkpoint.
CHECKPOINT_CHARS = 300
#: The key of the `system` session entry that keeps the ACP session's id.
ACP_SESSION_KEY = "acp_session"
#: What a resumed instance is prompted with when the resume brings no message.
GO_ON = "Go on with your task."


def first_option(options: list[PermissionOption], allowing: bool) -> str | None:
    """The first option that allows (or, with `allowing` False, rejects)."""
    prefix = "allow" if allowing else "reject"
    return next((o.option_id for o in options if o.kind.startswith(prefix)), None)


def acp_session_of(entries: list[SessionEntry]) -> str | None:
    """The id of the last ACP session kept in an agent's session entries."""
    for entry in reversed(entries):
        if entry.kind != "system":
            continue
        with contextlib.suppress(ValueError):
            data = json.loads(entry.content)
            if isinstance(data, dict) and isinstance(data.get(ACP_SESSION_KEY), str):
                return str(data[ACP_SESSION_KEY])
    return None


def first_prompt(run: AgentRun, loaded: bool) -> str:
    """What the instance's one turn is prompted with."""
    if run.start != "resume":
        return run.message if run.message is not None else run.spawn.task
    message = run.message or GO_ON
    return message if loaded else f"{run.spawn.task}\n\n{message}"


def choose_option(answer: str, options: list[PermissionOption]) -> str | None:
    """The option an answer picks: by id or name, or the first allowing one for an approval;
    None for anything else (the request is cancelled)."""
    said = answer.strip().lower()
    for option in options:
        if said in (option.option_id.lower(), option.name.lower()):
            return option.option_id
    if said in APPROVALS:
        return first_option(options, allowing=True)
    return None


class GroveAcpClient:
    """The ACP client side for one agent instance: updates to statuses, permissions checked
    and asked up the tree, files and terminals served by its host."""

    def __init__(self, context: AgentContext, host: AcpHost) -> None:
        self.context = context
        self.host = host
        self.answer: list[str] = []
        #: While a session loads, the agent replays its history: none of it is the answer.
        self.loading = False

    async def session_update(self, session_id: str, update: Any, **kwargs: Any) -> None:
        """Collect the answer's text; report plans and tool calls as checkpoints."""
        if self.loading or isinstance(update, UserMessageChunk | AgentThoughtChunk):
            return
        if isinstance(update, AgentMessageChunk):
            text = getattr(update.content, "text", None)
            if isinstance(text, str):
                self.answer.append(text)
        elif isinstance(update, AgentPlanUpdate):
            steps = "; ".join(f"{e.content} ({e.status})" for e in update.entries)
            await self.context.checkpoint(f"plan: {steps}"[:CHECKPOINT_CHARS], acp="plan")
        elif isinstance(update, ToolCallStart):
            await self.context.checkpoint(
                f"tool call: {update.title}"[:CHECKPOINT_CHARS],
                acp="tool_call",
                tool_call_id=update.tool_call_id,
            )
        elif isinstance(update, ToolCallProgress) and update.status in ("completed", "failed"):
            await self.context.report(
                "checkpoint",
                f"tool call {update.status}: {update.title or update.tool_call_id}"[
                    :CHECKPOINT_CHARS
                ],
                acp="tool_call_update",
                tool_call_id=update.tool_call_id,
            )

    async def request_permission(
        self,
        session_id: str,
        tool_call: ToolCallUpdate,
        options: list[PermissionOption],
        **kwargs: Any,
    ) -> RequestPermissionResponse:
        """Allow what the agent's permissions hold; ask up the tree for the rest."""
        what = tool_call.title or tool_call.tool_call_id
        capability = tool_capability(tool_call.kind)
        if capability is not None:
            try:
                await self.context.require_permission(capability, what)
            except PermissionDenied:
                return _pick(first_option(options, allowing=False))
            return _pick(first_option(options, allowing=True))
        answer = await self.context.ask_human(
            f"agent {self.context.agent_id} asks permission: {what}",
            options=[option.name for option in options],
        )
        return _pick(choose_option(answer, options))

    async def read_text_file(
        self,
        session_id: str,
        path: str,
        line: int | None = None,
        limit: int | None = None,
        **kwargs: Any,
    ) -> Any:
        """`fs/read_text_file`, with `fs.read`, inside the workspace."""
        return await self.host.read_text_file(path, line, limit)

    async def write_text_file(self, session_id: str, path: str, content: str, **kwargs: Any) -> Any:
        """`fs/write_text_file`, with `fs.write`, inside the workspace."""
        return await self.host.write_text_file(path, content)

    async def create_terminal(
        self,
        session_id: str,
        *,
        command: str,
        args: list[str] | None = None,
        env: list[Any] | None = None,
        cwd: str | None = None,
        output_byte_limit: int | None = None,
        **kwargs: Any,
    ) -> Any:
        """`terminal/create`, with `shell`, inside the workspace."""
        return await self.host.create_terminal(command, args, env, cwd, output_byte_limit)

    async def terminal_output(self, session_id: str, terminal_id: str, **kwargs: Any) -> Any:
        """`terminal/output`."""
        return await self.host.terminal_output(terminal_id)

    async def wait_for_terminal_exit(self, session_id: str, terminal_id: str, **kwargs: Any) -> Any:
        """`terminal/wait_for_exit`."""
        return await self.host.wait_for_terminal_exit(terminal_id)

    async def kill_terminal(self, session_id: str, terminal_id: str, **kwargs: Any) -> Any:
        """`terminal/kill`."""
        return await self.host.kill_terminal(terminal_id)

    async def release_terminal(self, session_id: str, terminal_id: str, **kwargs: Any) -> Any:
        """`terminal/release`."""
        return await self.host.release_terminal(terminal_id)


def _pick(option_id: str | None) -> RequestPermissionResponse:
    if option_id is None:
        return RequestPermissionResponse(outcome=DeniedOutcome(outcome="cancelled"))
    return RequestPermissionResponse(
        outcome=AllowedOutcome(outcome="selected", option_id=option_id)
    )


class AcpRuntime:
    """Runs an ACP agent's process and one prompt turn."""

    name = "acp"

    async def run(self, run: AgentRun) -> Outcome:
        """Initialize, open a session, prompt; the answer's text is the result."""
        spawn = run.spawn
        argv = spawn.config.command
        assert argv is not None
        env = {
            **process_environment(run),
            "GROVE_TASK": spawn.task,
            "GROVE_SESSION_ID": spawn.session_id or spawn.agent_id,
            "GROVE_START": run.start,
        }
        host = AcpHost(run.context, run.workspace, env)
        client = GroveAcpClient(run.context, host)
        try:
            async with (
                spawn_agent_process(
                    client,  # type: ignore[arg-type]
                    argv[0],
                    *argv[1:],
                    env=env,
                    cwd=run.workspace,
                    transport_kwargs={"stderr": None},
                ) as (conn, _process)
            ):
                init = await conn.initialize(
                    protocol_version=PROTOCOL_VERSION,
                    client_capabilities=await host.capabilities(),
                    client_info=Implementation(name="agentgrove", version="1"),
                )
                session_id, loaded = await self._open_session(conn, client, run, init)
                try:
                    response = await conn.prompt(
                        session_id=session_id, prompt=[text_block(first_prompt(run, loaded))]
                    )
                except asyncio.CancelledError:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(
                            asyncio.shield(conn.cancel(session_id=session_id)), CANCEL_GRACE_S
                        )
                    raise
        except (OSError, RequestError) as exc:
            return Outcome(
                completed=False,
                error=f"ACP agent {argv[0]!r}: {exc}",
                attempted=list(run.context.attempted),
                tokens=run.context.tokens,
            )
        finally:
            await host.close()
        answer = "".join(client.answer)
        if response.usage is not None and response.usage.total_tokens:
            await run.context.report_usage(response.usage.total_tokens)
        if answer:
            await run.context.record("assistant", answer)
        if response.stop_reason == "end_turn":
            return Outcome(completed=True, summary=answer, tokens=run.context.tokens)
        return Outcome(
            completed=False,
            error=f"ACP agent stopped its turn: {response.stop_reason}",
            attempted=list(run.context.attempted),
            partial_results=[answer] if answer else [],
            tokens=run.context.tokens,
        )

    @staticmethod
    async def _open_session(
        conn: Any, client: GroveAcpClient, run: AgentRun, init: Any
    ) -> tuple[str, bool]:
        """The ACP session to prompt, and whether it is an earlier instance's, loaded."""
        cwd = str(run.workspace)
        capabilities = getattr(init, "agent_capabilities", None)
        earlier = acp_session_of(run.context.history) if run.start == "resume" else None
        if earlier is not None and capabilities is not None and capabilities.load_session:
            client.loading = True
            try:
                await conn.load_session(cwd=cwd, session_id=earlier, mcp_servers=[])
            except RequestError as exc:
                await run.context.checkpoint(f"ACP session {earlier} not loaded: {exc}")
            else:
                await run.context.checkpoint(f"ACP session {earlier} loaded", acp="load_session")
                return earlier, True
            finally:
                client.loading = False
        session = await conn.new_session(cwd=cwd, mcp_servers=[])
        await run.context.record("system", json.dumps({ACP_SESSION_KEY: session.session_id}))
        return session.session_id, False

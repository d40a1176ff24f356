"""The `acp` runtime: an Agent Client Protocol agent over stdio (`config.command`).

The spawner is the ACP client: it starts the agent's process, initializes it, opens a session
and sends one prompt (the task, or the message a resumed or forked instance starts with). The
agent's session updates become `checkpoint` statuses (its plan, its tool calls and how they
end); the text it answers with is the result, recorded as an `assistant` entry. Its
permission requests become HITL questions up the tree, the options by name; an answer naming
an option picks it, an approval (`approve`, `yes`...) picks the first allowing option, anything
else cancels the request. A stop sends `session/cancel`, then the process is closed (stdin,
then SIGTERM, then SIGKILL). A resumed instance opens a new ACP session.

The process gets the same environment as a `command` agent (GROVE_AGENT_ID, GROVE_NATS_URL,
the spawner's NATS credentials), so it can run `grove mcp` as itself; no file system or
terminal capability is offered to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
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
    AllowedOutcome,
    ClientCapabilities,
    DeniedOutcome,
    Implementation,
    PermissionOption,
    ToolCallProgress,
    ToolCallStart,
    ToolCallUpdate,
)

from agentgrove.context import AgentContext
from grove_spawner.runtimes import AgentRun, Outcome

#: Seconds a cancelled agent gets to hear `session/cancel` before its process is closed.
CANCEL_GRACE_S = 2.0
#: Answers to a permission question that pick the first allowing option.
APPROVALS = frozenset({"approve", "approved", "allow", "allowed", "yes", "grant", "ok"})
#: How much of a plan or tool call title goes into a checkpoint.
CHECKPOINT_CHARS = 300


def choose_option(answer: str, options: list[PermissionOption]) -> str | None:
    """The option an answer picks: by id or name, or the first allowing one for an approval;
    None for anything else (the request is cancelled)."""
    said = answer.strip().lower()
    for option in options:
        if said in (option.option_id.lower(), option.name.lower()):
            return option.option_id
    if said in APPROVALS:
        allowing = [o for o in options if o.kind.startswith("allow")]
        if allowing:
            return allowing[0].option_id
    return None


class GroveAcpClient:
    """The ACP client side for one agent instance: updates to statuses, permissions to HITL."""

    def __init__(self, context: AgentContext) -> None:
        self.context = context
        self.answer: list[str] = []

    async def session_update(self, session_id: str, update: Any, **kwargs: Any) -> None:
        """Collect the answer's text; report plans and tool calls as checkpoints."""
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
        """Ask up the tree; the answer picks an option or cancels the request."""
        what = tool_call.title or tool_call.tool_call_id
        answer = await self.context.ask_human(
            f"agent {self.context.agent_id} asks permission: {what}",
            options=[option.name for option in options],
        )
        chosen = choose_option(answer, options)
        if chosen is None:
            return RequestPermissionResponse(outcome=DeniedOutcome(outcome="cancelled"))
        return RequestPermissionResponse(
            outcome=AllowedOutcome(outcome="selected", option_id=chosen)
        )

    async def write_text_file(self, *args: Any, **kwargs: Any) -> None:
        """Not offered: the agent works on its own files."""
        raise RequestError.method_not_found("fs/write_text_file")

    async def read_text_file(self, *args: Any, **kwargs: Any) -> None:
        """Not offered: the agent works on its own files."""
        raise RequestError.method_not_found("fs/read_text_file")


class AcpRuntime:
    """Runs an ACP agent's process and one prompt turn."""

    name = "acp"

    async def run(self, run: AgentRun) -> Outcome:
        """Initialize, open a session, prompt; the answer's text is the result."""
        spawn = run.spawn
        argv = spawn.config.command
        assert argv is not None
        env = {
            **os.environ,
            **run.env,
            "GROVE_TASK": spawn.task,
            "GROVE_SESSION_ID": spawn.session_id or spawn.agent_id,
            "GROVE_START": run.start,
        }
        client = GroveAcpClient(run.context)
        text = run.message if run.message is not None else spawn.task
        try:
            async with (
                spawn_agent_process(
                    client,  # type: ignore[arg-type]
                    argv[0],
                    *argv[1:],
                    env=env,
                    transport_kwargs={"stderr": None},
                ) as (conn, _process)
            ):
                await conn.initialize(
                    protocol_version=PROTOCOL_VERSION,
                    client_capabilities=ClientCapabilities(),
                    client_info=Implementation(name="agentgrove", version="1"),
                )
                session = await conn.new_session(cwd=os.getcwd(), mcp_servers=[])
                try:
                    response = await conn.prompt(
                        session_id=session.session_id, prompt=[text_block(text)]
                    )
                except asyncio.CancelledError:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(
                            asyncio.shield(conn.cancel(session_id=session.session_id)),
                            CANCEL_GRACE_S,
                        )
                    raise
        except (OSError, RequestError) as exc:
            return Outcome(
                completed=False,
                error=f"ACP agent {argv[0]!r}: {exc}",
                attempted=list(run.context.attempted),
                tokens=run.context.tokens,
            )
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

"""`grove mcp`: the control tools of one agent over MCP (stdio), for any MCP-capable agent.

The server acts as an agent that exists in the log (`--agent-id`, or GROVE_AGENT_ID, which
the `command` runtime gives its process): children it spawns are that agent's children, its
questions go up that agent's path, its permissions are that agent's. The tools are the ones
the `openai` runtime gives a model (`agentgrove.context.control_tools`), with the same
descriptions and arguments. What the server records goes to a session in memory: a command
agent's own session is what the spawner records of its output.
"""

from __future__ import annotations

import inspect
import json
from typing import Annotated, Any

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import Field

from agentgrove.client import UnknownAgent
from agentgrove.context import TOOL_ERRORS, AgentContext, ControlTool, control_tools
from grove_core.log import EventLog
from grove_core.records import RawRecord, decode_record
from grove_events import ForkEvent, InvalidEvent, SpawnEvent, StatusEvent, subject_for

#: How deep a chain of forks of forks is followed back to its spawn.
MAX_FORK_DEPTH = 64
INSTRUCTIONS = (
    "You are agent {agent_id} in an AgentGrove tree. These tools manage your children and "
    "talk to the rest of the tree: `task` delegates to a subagent profile and waits for its "
    "report; `spawn_agent` starts a child you `wait` for; `read_inbox` has what was sent to "
    "you; `get_resource_status` tells how much capacity is left."
)


def _decoded(record: RawRecord | None) -> Any:
    if record is None:
        return None
    try:
        return decode_record(record).event
    except InvalidEvent:
        return None


async def agent_spawn(log: EventLog, agent_id: str) -> SpawnEvent:
    """The spawn an agent runs as; for a fork, its source's with what the fork changes.
    UnknownAgent when the log has neither."""
    forks: list[ForkEvent] = []
    current = agent_id
    for _ in range(MAX_FORK_DEPTH):
        spawn = _decoded(await log.get_last(subject_for("spawn", current)))
        if isinstance(spawn, SpawnEvent):
            break
        fork = _decoded(await log.get_last(subject_for("fork", current)))
        if not isinstance(fork, ForkEvent):
            raise UnknownAgent(agent_id)
        forks.append(fork)
        current = fork.source_agent
    else:
        raise UnknownAgent(agent_id)
    for fork in reversed(forks):
        spawn = spawn.model_copy(
            update={
                "event_id": fork.event_id,
                "agent_id": fork.agent_id,
                "session_id": fork.session_id,
                "tree_id": fork.tree_id or spawn.tree_id,
                "task": fork.task or spawn.task,
                "config": fork.config or spawn.config,
                "fork_from": fork.source_agent,
            }
        )
    return spawn


async def agent_context(log: EventLog, agent_id: str) -> AgentContext:
    """An AgentContext acting as the existing agent `agent_id`."""
    spawn = await agent_spawn(log, agent_id)
    status = _decoded(await log.get_last(subject_for("status", agent_id)))
    tree_id = (status.tree_id if isinstance(status, StatusEvent) and status.tree_id else None) or (
        spawn.tree_id or agent_id
    )
    return AgentContext(log, spawn, tree_id)


def _mcp_function(context: AgentContext, tool: ControlTool) -> Any:
    """An async function MCP can describe (its signature is the tool's arguments) that runs
    the tool; what the caller did wrong comes back as a tool error with the reason."""

    async def call(**arguments: Any) -> str:
        try:
            result = await tool.invoke(context, arguments)
        except TOOL_ERRORS as exc:
            raise ToolError(str(exc) or exc.__class__.__name__) from None
        return json.dumps(result, default=str)

    parameters = []
    for name, field in tool.arguments.model_fields.items():
        # The type with its constraints, and the description a model reads.
        annotation = Annotated.__class_getitem__(  # type: ignore[attr-defined]
            (field.rebuild_annotation(), Field(description=field.description))
        )
        default = (
            inspect.Parameter.empty
            if field.is_required()
            else field.get_default(call_default_factory=True)
        )
        parameters.append(
            inspect.Parameter(
                name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation
            )
        )
    call.__signature__ = inspect.Signature(parameters, return_annotation=str)  # type: ignore[attr-defined]
    call.__name__ = tool.name
    return call


def build_server(context: AgentContext) -> MCPServer:
    """An MCP server with the control tools of `context`'s agent."""
    server: MCPServer = MCPServer(
        name="agentgrove", instructions=INSTRUCTIONS.format(agent_id=context.agent_id)
    )
    for tool in control_tools(context.subagent_profiles()):
        server.add_tool(
            _mcp_function(context, tool),
            name=tool.name,
            description=tool.description,
            structured_output=False,
        )
    return server


async def serve_stdio(log: EventLog, agent_id: str) -> None:
    """Serve the control tools of `agent_id` on stdin/stdout until the client leaves."""
    context = await agent_context(log, agent_id)
    await build_server(context).run_stdio_async()

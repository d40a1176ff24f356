"""`grove mcp`: serve an agent's control tools over MCP on stdin/stdout."""

from __future__ import annotations

import argparse
import os

from agentgrove.cli.common import (
    CliError,
    Parser,
    Subcommands,
    agent_id,
    nats_url,
    require_agent,
    run_async,
)
from agentgrove.client import GroveClient
from grove_events.envelope import TOKEN_PATTERN


def identity(args: argparse.Namespace) -> str:
    """The agent the server acts as: --agent-id, else GROVE_AGENT_ID."""
    given: str | None = args.agent_id or os.environ.get("GROVE_AGENT_ID")
    if not given:
        raise CliError(
            "grove mcp acts as an agent: give --agent-id ID or set GROVE_AGENT_ID "
            "(the command runtime sets it for the agents it runs)"
        )
    if not TOKEN_PATTERN.fullmatch(given):
        raise CliError(f"GROVE_AGENT_ID {given!r} is not an agent id")
    return given


async def serve(args: argparse.Namespace) -> int:
    """`grove mcp`: connect as the agent and serve until the client closes stdin."""
    # The MCP library takes half a second to import: only this command pays for it.
    from agentgrove.mcp_server import serve_stdio  # noqa: PLC0415

    me = identity(args)
    async with await GroveClient.connect(nats_url(args)) as client:
        await require_agent(client, me)
        await serve_stdio(client.log, me)
    return 0


def add_commands(commands: Subcommands, common: Parser) -> None:
    """Register `mcp`."""
    mcp = commands.add_parser(
        "mcp",
        parents=[common],
        help="serve an agent's control tools over MCP on stdio (spawn, task, wait, ...)",
        description="An MCP server on stdin/stdout with the control tools of one agent "
        "(spawn_agent, fork_agent, task, wait, stop_agent, send_message, read_inbox, "
        "get_resource_status, ...), acting as that agent.",
    )
    mcp.add_argument(
        "--agent-id",
        metavar="ID",
        type=agent_id,
        help="the agent to act as (default: $GROVE_AGENT_ID)",
    )
    mcp.set_defaults(handler=run_async(serve))

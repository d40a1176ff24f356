"""`grove status`, `grove resume` and `grove fork`: the governor's view, and steering agents."""

from __future__ import annotations

import argparse
import json
from typing import Any

from agentgrove.cli.common import (
    CliError,
    Parser,
    Subcommands,
    agent_id,
    connect,
    decode_item,
    nats_url,
    out,
    require_agent,
    run_async,
)
from agentgrove.client import build_config
from grove_core.records import Recorded
from grove_events import AgentConfig, TerminateEvent, agent_wildcard


def status_lines(answer: dict[str, Any]) -> list[str]:
    """The governor's resource status as lines a person reads."""
    glob = answer["global"]
    capacity = glob.get("capacity")
    lines = [
        f"agents running: {glob['agents_running']}"
        + (f" of {capacity} ({glob['utilization']:.0%})" if capacity else " (no capacity limit)"),
        f"queued: {glob.get('queued', 0)}",
        "admissions: " + ("PAUSED (resume_all lifts it)" if glob.get("paused") else "open"),
    ]
    own = answer.get("self")
    if own is not None:
        limit = own.get("children_limit")
        lines += [
            f"agent {own['agent_id']}: {own['phase']}",
            f"  children running: {own['children_running']}"
            + (f" of {limit}" if limit is not None else " (no child limit)"),
            f"  runtime: {own['runtime_elapsed']:.1f}s",
            f"  tokens: {own['tokens']} (tree: {own['tree_tokens']})",
        ]
    return lines


async def show_status(args: argparse.Namespace) -> int:
    """`grove status`: the governor's resource status, system-wide or for one agent."""
    async with connect(nats_url(args)) as conn:
        if args.agent is not None:
            await require_agent(conn.client, args.agent)
        answer = await conn.guard(conn.client.resource_status(args.agent))
    if args.json:
        out(json.dumps(answer, indent=2))
    else:
        for line in status_lines(answer):
            out(line)
    return 0


async def resume_agent(args: argparse.Namespace) -> int:
    """`grove resume`: run a stopped agent again on its session."""
    async with connect(nats_url(args)) as conn:
        await require_agent(conn.client, args.agent_id)
        last = await conn.log.get_last(agent_wildcard(args.agent_id))
        ended = decode_item(last)[1] if last is not None else None
        if not (isinstance(ended, Recorded) and isinstance(ended.event, TerminateEvent)):
            raise CliError(
                f"agent {args.agent_id} has not ended; only an ended agent can be resumed "
                f"(`grove stop {args.agent_id}` first)"
            )
        await conn.client.resume(args.agent_id, args.message)
    out(f"resume requested for {args.agent_id}")
    return 0


def fork_config(args: argparse.Namespace) -> AgentConfig | None:
    """The fork's own config from --config or --entrypoint, or None: it runs like its source."""
    if args.config is not None:
        if args.entrypoint is not None:
            raise CliError("give --config or --entrypoint, not both")
        return AgentConfig.model_validate_json(args.config)
    if args.entrypoint is None:
        return None
    return build_config("python", entrypoint=args.entrypoint)


async def fork_agent(args: argparse.Namespace) -> int:
    """`grove fork`: a new agent in the same tree from a copy of the source's session."""
    config = fork_config(args)
    async with connect(nats_url(args)) as conn:
        await require_agent(conn.client, args.source)
        fork_id = await conn.client.fork(
            args.source,
            args.reason,
            task=args.task,
            initial_message=args.message,
            config=config,
            subscriptions=args.subscribe,
        )
    out(fork_id)
    return 0


def add_commands(commands: Subcommands, common: Parser) -> None:
    """Register `status`, `resume` and `fork`."""
    status = commands.add_parser(
        "status", parents=[common], help="the resource governor's status (capacity, queue)"
    )
    status.add_argument("--agent", metavar="ID", type=agent_id, help="also this agent's own")
    status.add_argument("--json", action="store_true", help="the governor's answer as JSON")
    status.set_defaults(handler=run_async(show_status))

    resume = commands.add_parser(
        "resume", parents=[common], help="run an ended agent again on its session"
    )
    resume.add_argument("agent_id", type=agent_id)
    resume.add_argument(
        "--message", metavar="TEXT", help="the next user message of the resumed session"
    )
    resume.set_defaults(handler=run_async(resume_agent))

    fork = commands.add_parser(
        "fork",
        parents=[common],
        help="fork an agent: a new agent from a copy of its session (the source goes on)",
    )
    fork.add_argument("source", type=agent_id, help="the agent to fork")
    fork.add_argument("--reason", metavar="TEXT", required=True, help="why (the fork is told)")
    fork.add_argument("--task", metavar="TEXT", help="the fork's own task (default: the source's)")
    fork.add_argument("--message", metavar="TEXT", help="the fork's first user message")
    fork.add_argument(
        "--entrypoint",
        metavar="MODULE:FUNCTION",
        help="run the fork as this python agent (default: as its source)",
    )
    fork.add_argument(
        "--config",
        metavar="JSON",
        help='the fork\'s whole config, e.g. \'{"runtime": "command", "command": ["wc", "-w"]}\'',
    )
    fork.add_argument(
        "--subscribe",
        metavar="SUBSCRIPTION",
        action="append",
        help="also deliver these to the fork's inbox (topic:NAME, agent:ID, ...; repeatable)",
    )
    fork.set_defaults(handler=run_async(fork_agent))

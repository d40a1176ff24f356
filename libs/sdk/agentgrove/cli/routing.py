"""`grove send`, `grove answer`, `grove pending`, `grove show` and `grove inbox`: messages,
questions for a human, and the router's view of an agent."""

from __future__ import annotations

import argparse
import json
from typing import Any

from agentgrove.cli.common import (
    CliError,
    Parser,
    Subcommands,
    agent_id,
    clip,
    connect,
    nats_url,
    out,
    positive_float,
    positive_int,
    require_agent,
    run_async,
    short_id,
)
from agentgrove.routing import AlreadyAnswered, InboxItem, UnknownRequest


def position(value: str) -> int:
    """An argparse type: an inbox position, 0 or more."""
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from None
    if number < 0:
        raise argparse.ArgumentTypeError(f"{value} must be 0 or more")
    return number


def priority(value: str) -> int:
    """An argparse type: a message priority, -10 to 10."""
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from None
    if not -10 <= number <= 10:
        raise argparse.ArgumentTypeError(f"priority {number} must be between -10 and 10")
    return number


async def send_message(args: argparse.Namespace) -> int:
    """`grove send`: a message to an agent or a topic; prints its event id."""
    async with connect(nats_url(args)) as conn:
        message_id = await conn.guard(
            conn.client.send(
                args.text,
                to=args.to,
                topic=args.topic,
                priority=args.priority,
                ttl=args.ttl,
                requires_ack=args.wait_ack is not None,
                correlation_id=args.correlation_id,
            )
        )
        out(message_id)
        if args.wait_ack is not None:
            try:
                ack = await conn.guard(conn.client.routing.wait_ack(message_id, args.wait_ack))
            except TimeoutError:
                raise CliError(
                    f"no acknowledgement of {message_id} within {args.wait_ack:g}s; the "
                    "recipient acknowledges when it reads the message"
                ) from None
            out(f"acknowledged by {ack.from_}")
    return 0


async def answer_request(args: argparse.Namespace) -> int:
    """`grove answer`: answer a HITL request; it reaches exactly the agent that asked."""
    async with connect(nats_url(args)) as conn:
        try:
            request = await conn.guard(conn.client.routing.request(args.request_id))
            await conn.guard(conn.client.answer(args.request_id, args.text))
        except (UnknownRequest, AlreadyAnswered) as exc:
            raise CliError(str(exc)) from None
    out(f"answered {args.request_id} for agent {request['agent_id']}")
    return 0


def request_lines(request: dict[str, Any]) -> list[str]:
    """One open request as lines a person reads."""
    path = " > ".join(short_id(a) for a in request["agent_path"])
    kind = request["kind"]
    if request.get("capability"):
        kind += f" ({request['capability']})"
    lines = [f"{request['request_id']}  {kind}  from {path}", f"  {clip(request['prompt'], 200)}"]
    if request["options"]:
        lines.append(f"  options: {', '.join(request['options'])}")
    if request.get("summary"):
        lines.append(f"  task: {clip(request['summary'], 200)}")
    return lines


async def list_pending(args: argparse.Namespace) -> int:
    """`grove pending`: open questions and permission requests, oldest first."""
    async with connect(nats_url(args)) as conn:
        if args.tree is not None:
            await require_agent(conn.client, args.tree)
        requests = await conn.guard(conn.client.pending(args.tree))
    if args.json:
        out(json.dumps(requests, indent=2))
        return 0
    if not requests:
        out("(no open requests)")
        return 0
    for request in requests:
        for line in request_lines(request):
            out(line)
    out(f"({len(requests)} open; answer one with: grove answer REQUEST_ID TEXT)")
    return 0


def summary_lines(summary: dict[str, Any], hierarchy: dict[str, Any]) -> list[str]:
    """An agent's summary as lines a person reads."""
    permissions = summary["permissions"]
    lines = [
        f"agent {summary['agent_id']}: {summary['state']}",
        f"  path: {' > '.join(hierarchy['agent_path'])}",
        f"  task: {clip(summary['task'], 200)}",
        f"  last status: {summary['last_status'] or '-'}"
        + (f": {clip(summary['summary'], 150)}" if summary["summary"] else ""),
    ]
    if summary["error"]:
        lines.append(f"  error: {clip(summary['error'], 200)}")
    lines += [
        f"  tokens: {summary['usage']['tokens']}",
        "  capabilities: "
        + ("all" if permissions is None else ", ".join(permissions) or "none")
        + (f" (granted: {', '.join(summary['granted'])})" if summary["granted"] else ""),
        f"  subscriptions: {', '.join(summary['subscriptions']) or 'none'}",
        "  inbox: {delivered} delivered, {committed} read, {held} held".format(**summary["inbox"]),
    ]
    for child in summary["children"]:
        lines.append(f"  child {child['agent_id']}: {child['state']}")
    for question in summary["pending_questions"]:
        lines.append(
            f"  open {question['kind']} {question['request_id']}: {clip(question['prompt'], 120)}"
        )
    return lines


async def show_agent(args: argparse.Namespace) -> int:
    """`grove show`: the router's summary of one agent."""
    async with connect(nats_url(args)) as conn:
        await require_agent(conn.client, args.agent_id)
        summary = await conn.guard(conn.client.routing.summary(args.agent_id))
        hierarchy = await conn.guard(conn.client.routing.hierarchy(args.agent_id))
    if args.json:
        out(json.dumps({**summary, "hierarchy": hierarchy["root"]}, indent=2))
    else:
        for line in summary_lines(summary, hierarchy):
            out(line)
    return 0


def inbox_line(item: InboxItem) -> str:
    """One inbox entry on one line."""
    source = short_id(item.source) if item.source else "caller"
    mark = " injected" if item.injected else ""
    return (
        f"{item.index:>5}  seq {item.seq:<6} {item.type:<9} from {source:<12} "
        f"via {item.via}{mark}: {clip(item.text, 80)}"
    )


async def show_inbox(args: argparse.Namespace) -> int:
    """`grove inbox`: what has been delivered to an agent (without taking it)."""
    async with connect(nats_url(args)) as conn:
        await require_agent(conn.client, args.agent_id)
        items, answer = await conn.guard(
            conn.client.routing.inbox(args.agent_id, args.after, limit=args.limit, fresh=True)
        )
    for item in items:
        if args.json:
            out(
                json.dumps(
                    {
                        "index": item.index,
                        "seq": item.seq,
                        "type": item.type,
                        "source": item.source,
                        "agent_path": item.agent_path,
                        "via": item.via,
                        "priority": item.priority,
                        "injected": item.injected,
                        "text": item.text,
                    }
                )
            )
        else:
            out(inbox_line(item))
    if not args.json:
        out(
            f"({answer['delivered']} delivered, {answer['committed']} read by the agent, "
            f"{answer['held']} held until it runs)"
        )
    return 0


def add_commands(commands: Subcommands, common: Parser) -> None:
    """Register `send`, `answer`, `pending`, `show` and `inbox`."""
    send = commands.add_parser(
        "send", parents=[common], help="send a message to an agent or a topic"
    )
    send.add_argument("text", help="the message")
    target = send.add_mutually_exclusive_group(required=True)
    target.add_argument("--to", metavar="ID", type=agent_id, help="the agent it is for")
    target.add_argument("--topic", metavar="NAME", help="the topic it is published to")
    send.add_argument(
        "--priority", metavar="N", type=priority, default=0, help="-10..10; higher is read first"
    )
    send.add_argument(
        "--ttl", metavar="S", type=positive_float, help="seconds before an undelivered copy expires"
    )
    send.add_argument("--correlation-id", metavar="ID", type=agent_id, help="thread id")
    send.add_argument(
        "--wait-ack",
        metavar="S",
        type=positive_float,
        help="ask for an acknowledgement and wait for it at most S seconds",
    )
    send.set_defaults(handler=run_async(send_message))

    answer = commands.add_parser(
        "answer", parents=[common], help="answer a question or permission request"
    )
    answer.add_argument("request_id", type=agent_id, help="the request (see `grove pending`)")
    answer.add_argument("text", help="the answer; approve/allow/yes grants a permission")
    answer.set_defaults(handler=run_async(answer_request))

    pending = commands.add_parser(
        "pending", parents=[common], help="open questions and permission requests"
    )
    pending.add_argument("--tree", metavar="ROOT_ID", type=agent_id, help="only this tree's")
    pending.add_argument("--json", action="store_true", help="the router's answer as JSON")
    pending.set_defaults(handler=run_async(list_pending))

    show = commands.add_parser("show", parents=[common], help="one agent as the router sees it")
    show.add_argument("agent_id", type=agent_id)
    show.add_argument("--json", action="store_true", help="summary and hierarchy as JSON")
    show.set_defaults(handler=run_async(show_agent))

    inbox = commands.add_parser("inbox", parents=[common], help="what was delivered to an agent")
    inbox.add_argument("agent_id", type=agent_id)
    inbox.add_argument(
        "--after", metavar="N", type=position, default=0, help="only entries after position N"
    )
    inbox.add_argument("--limit", metavar="N", type=positive_int, default=100)
    inbox.add_argument("--json", action="store_true", help="JSON lines")
    inbox.set_defaults(handler=run_async(show_inbox))

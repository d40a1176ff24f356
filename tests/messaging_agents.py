"""Python-runtime agents of the message, injection and capability tests, as
`tests.messaging_agents:<function>`."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from agentgrove import build_config
from agentgrove.context import AgentContext
from agentgrove.routing import InboxItem, PermissionDenied
from grove_events import MessageEvent

#: How often an agent waiting for its inbox to fill asks the router.
POLL_S = 0.1


def entry(item: InboxItem) -> list[Any]:
    """An inbox entry as [type, via, text, injected]."""
    return [item.type, item.via, item.text, item.injected]


async def wait_delivered(ctx: AgentContext, count: int) -> None:
    """Wait until `count` entries have been delivered to this agent's inbox (read or not)."""
    while True:
        summary = await ctx.get_agent_summary()
        if summary["inbox"]["delivered"] >= count:
            return
        await asyncio.sleep(POLL_S)


async def reads_in_phases(ctx: AgentContext) -> str:
    """Reads its inbox late, in phases. Task: `{"phases": [[delivered, take], ...], "pause": s}`:
    for each phase it waits until `delivered` entries are in its inbox, sleeps `pause` seconds,
    takes `take` entries one by one (`next_message`) and reports a checkpoint `phase N`; then it
    takes whatever is left at once (`inbox`). Returns JSON {"entries": [[type, via, text,
    injected]...] in the order read, "expired": messages skipped because their ttl ran out}."""
    spec = json.loads(ctx.task)
    read: list[list[Any]] = []
    for number, (delivered, take) in enumerate(spec["phases"]):
        await wait_delivered(ctx, delivered)
        await asyncio.sleep(spec.get("pause", 0))
        for _ in range(take):
            read.append(entry(await ctx.next_message(timeout=30)))
        await ctx.checkpoint(f"phase {number}")
    read.extend(entry(item) for item in await ctx.inbox())
    return json.dumps({"entries": read, "expired": ctx.expired_messages})


async def requester(ctx: AgentContext) -> str:
    """Sends "ping" to the agent in its task with `requires_ack` and a correlation id, then
    reads its inbox until it has both the acknowledgement and the reply. Returns JSON: the sent
    message's id and, for the ack and the reply, their fields that thread them."""
    spec = json.loads(ctx.task)
    sent = await ctx.send_message(
        "ping", to=spec["to"], requires_ack=True, correlation_id=spec["correlation_id"]
    )
    found: dict[str, dict[str, Any]] = {}
    while len(found) < 2:
        event = (await ctx.next_message(timeout=30)).event
        if isinstance(event, MessageEvent):
            found["ack" if event.ack_of is not None else "reply"] = {
                "from": event.from_,
                "to": event.to,
                "ack_of": event.ack_of,
                "correlation_id": event.correlation_id,
                "causation_id": event.causation_id,
                "content": event.content,
            }
    return json.dumps({"sent": sent, **found})


async def responder(ctx: AgentContext) -> str:
    """Takes one message (acknowledging it if asked to, as `next_message` does), replies to its
    sender in the same thread (its correlation id). Returns JSON of what it read."""
    item = await ctx.next_message(timeout=30)
    event = item.event
    assert isinstance(event, MessageEvent)
    await ctx.send_message(
        f"pong to {event.content}", to=event.from_, correlation_id=event.correlation_id
    )
    return json.dumps(
        {
            "content": event.content,
            "from": item.source,
            "correlation_id": event.correlation_id,
            "requires_ack": event.requires_ack,
        }
    )


async def injecting_parent(ctx: AgentContext) -> str:
    """Spawns a `reads_in_phases` child that waits for two entries, sends it a message, then
    injects one into its context; returns the child's result."""
    child = await ctx.spawn_agent(
        json.dumps({"phases": [[2, 2]]}),
        entrypoint="tests.messaging_agents:reads_in_phases",
    )
    await ctx.send_message("plain message", to=child)
    await ctx.inject_message(child, "injected: read me first")
    result = await ctx.wait(child, timeout=60)
    return json.dumps({"child": child, "result": json.loads(result.summary)})


async def done(ctx: AgentContext) -> str:
    """Ends at once."""
    return "child done"


async def scripted(ctx: AgentContext) -> str:
    """Runs the steps of its task (a JSON list) and returns, as a JSON list, what each gave:
    `spawn` publishes the spawn of a child straight to the log, without the SDK's own check of
    the `spawn` capability, and gives the child's end as [reason, error or summary];
    `ask:CAP` asks for the capability CAP and gives "granted" or "denied";
    `holds:CAP` gives whether this agent holds CAP; `read` waits for the next entry of its
    inbox and gives its text."""
    out: list[Any] = []
    for step in json.loads(ctx.task):
        verb, _, capability = step.partition(":")
        if verb == "spawn":
            child = await ctx._client.spawn(
                "a child spawned past the SDK's check",
                build_config("python", entrypoint="tests.messaging_agents:done"),
                parent=ctx.agent_id,
                tree_id=ctx.tree_id,
            )
            result = await ctx.wait(child, timeout=30)
            out.append([result.reason, result.error or result.summary])
        elif verb == "ask":
            try:
                await ctx.require_permission(capability, "the test needs it")
            except PermissionDenied:
                out.append("denied")
            else:
                out.append("granted")
        elif verb == "holds":
            out.append(await ctx.has_permission(capability))
        elif verb == "read":
            out.append((await ctx.next_message(timeout=60)).text)
        else:
            raise ValueError(f"unknown step {step!r}")
    return json.dumps(out)

"""Python-runtime agents of the routing and HITL tests, as `tests.routing_agents:<function>`."""

from __future__ import annotations

import asyncio
import json

from agentgrove.context import AgentContext
from agentgrove.routing import PermissionDenied


async def reader(ctx: AgentContext) -> str:
    """Reads the number of inbox entries in its task, committing after each; returns their
    texts as a JSON list."""
    count = int(ctx.task)
    texts = []
    for _ in range(count):
        item = await ctx.next_message(timeout=60)
        texts.append(item.text)
        await ctx.checkpoint(f"read {len(texts)}")
    return json.dumps(texts)


async def sleeps_then_drains(ctx: AgentContext) -> str:
    """First instance: waits to be stopped. A resumed instance returns, as a JSON list, the
    texts of the messages and injections in its inbox, in reading order."""
    if ctx.start != "resume":
        await asyncio.sleep(60)
        return "never stopped"
    items = await ctx.inbox()
    return json.dumps([item.text for item in items if item.type == "message" or item.injected])


async def asker(ctx: AgentContext) -> str:
    """Asks a human the question in its task; returns the answer."""
    answer = await ctx.ask_human(ctx.task, options=["left", "right"], timeout=60)
    return f"answer: {answer}"


async def middle(ctx: AgentContext) -> str:
    """Spawns an `asker` with its own task, waits for it, returns its result."""
    child = await ctx.spawn_agent(ctx.task, entrypoint="tests.routing_agents:asker")
    result = await ctx.wait(child, timeout=90)
    return result.summary


async def top(ctx: AgentContext) -> str:
    """Spawns a `middle` (which spawns an `asker`), waits, returns the result."""
    child = await ctx.spawn_agent(ctx.task, entrypoint="tests.routing_agents:middle")
    result = await ctx.wait(child, timeout=90)
    return result.summary


async def needs_capability(ctx: AgentContext) -> str:
    """Uses the capability named in its task: asks for it when it does not hold it."""
    try:
        await ctx.require_permission(ctx.task, "the test needs it")
    except PermissionDenied as exc:
        return f"denied: {exc}"
    return f"granted {ctx.task}"


async def capabilities(ctx: AgentContext) -> str:
    """Returns, as JSON, which of the capabilities in its task (comma separated) it holds."""
    names = ctx.task.split(",")
    return json.dumps({name: await ctx.has_permission(name) for name in names})


async def parent_of_limited(ctx: AgentContext) -> str:
    """Spawns a `capabilities` child asking for fs.read and net, returns the child's result."""
    child = await ctx.spawn_agent(
        "spawn,fs.read,net",
        entrypoint="tests.routing_agents:capabilities",
        permissions=["fs.read", "net"],
    )
    result = await ctx.wait(child, timeout=60)
    return result.summary


async def inspector(ctx: AgentContext) -> str:
    """Returns, as JSON, what the router's queries say about this agent and its tree."""
    hierarchy = await ctx.get_hierarchy()
    parent = await ctx.get_agent_summary(ctx.parent) if ctx.parent else None
    mine = await ctx.get_agent_summary()
    agents = await ctx.query_index("agents", {"tree_id": ctx.tree_id})
    return json.dumps(
        {
            "path": hierarchy["agent_path"],
            "root_children": [c["agent_id"] for c in hierarchy["root"]["children"]],
            "parent_state": parent["state"] if parent else None,
            "my_state": mine["state"],
            "tree_agents": sorted(row["agent_id"] for row in agents),
        }
    )

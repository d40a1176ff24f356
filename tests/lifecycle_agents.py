"""Python agents for the spawner's lifecycle tests, run as `tests.lifecycle_agents:<function>`."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from agentgrove.context import AgentContext


async def remembers(ctx: AgentContext) -> dict[str, Any]:
    """First run: records three entries, reports `checkpoint recorded`, then waits to be
    stopped. Resumed or forked: records that it went on and returns what it sees."""
    if ctx.start == "spawn":
        await ctx.record("assistant", "step 1")
        await ctx.record("tool_call", "look around")
        await ctx.record("tool_result", "found a clue")
        await ctx.checkpoint("recorded")
        await asyncio.sleep(60)
        return {"start": "spawn", "history": []}
    await ctx.record("assistant", "went on")
    return {
        "start": ctx.start,
        "message": ctx.resume_message,
        "fork_of": ctx.fork_of,
        "session_id": ctx.session_id,
        "history": [[entry.kind, entry.content] for entry in ctx.history],
    }


async def fails(ctx: AgentContext) -> str:
    """Tries something, keeps a partial result, then raises."""
    await ctx.checkpoint("tried the front door")
    ctx.partial_results.append("half a map")
    raise RuntimeError("the door is locked")


async def silent(ctx: AgentContext) -> str:
    """Ends well without saying so."""
    return "quietly done"


async def says_completed(ctx: AgentContext) -> str:
    """Reports its own completion, then ends."""
    await ctx.report("completed", "said so")
    return "done"


async def uses_tokens(ctx: AgentContext) -> str:
    """Reports token usage twice (120, then 30 more), then ends without saying so."""
    await ctx.report_usage(120)
    await ctx.report_usage(30)
    return "used"


async def swallows_a_cancel(ctx: AgentContext) -> str:
    """Waits to be stopped, but the first cancellation is lost on the way (as one racing with
    a reply is in `asyncio.wait_for` before Python 3.12)."""
    await ctx.checkpoint("waiting")
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.sleep(3600)
    await asyncio.sleep(3600)
    return "never"


async def deaf(ctx: AgentContext) -> str:
    """Goes on for six seconds whatever happens (every cancellation swallowed), then returns."""
    await ctx.checkpoint("not listening")
    loop = asyncio.get_running_loop()
    until = loop.time() + 6
    while (left := until - loop.time()) > 0:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(left)
    return "finished regardless"

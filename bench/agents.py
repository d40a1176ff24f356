"""The agents the benchmark runs on the `python` runtime, as `bench.agents:<function>`."""

from __future__ import annotations

import asyncio

from agentgrove.context import AgentContext


async def trivial(ctx: AgentContext) -> str:
    """Ends at once."""
    return "ok"


async def holder(ctx: AgentContext) -> str:
    """Runs until stopped (at most the number of seconds in its task)."""
    await asyncio.sleep(float(ctx.task))
    return "held"

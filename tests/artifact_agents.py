"""Python agents of the artifact tests, as `tests.artifact_agents:<function>`."""

from __future__ import annotations

import hashlib

from agentgrove.context import AgentContext


def alphabet(length: int) -> str:
    """`length` characters cycling through a-z: a result whose every cut is easy to check."""
    return "".join(chr(ord("a") + i % 26) for i in range(length))


async def long_result(ctx: AgentContext) -> str:
    """Returns a text of as many characters as its task says."""
    return alphabet(int(ctx.task))


async def reads_child_result(ctx: AgentContext) -> str:
    """Spawns a `long_result` child of the length in its task, then reads the child's whole
    result by its handle; returns `<child id> <length> <sha256>` of what it read."""
    child = await ctx.spawn_agent(ctx.task, entrypoint="tests.artifact_agents:long_result")
    result = await ctx.wait(child, timeout=60)
    if result.artifact is None:
        return f"{child} 0 no-artifact:{result.error}"
    text = (await ctx.get_artifact(result.artifact)).decode()
    return f"{child} {len(text)} {hashlib.sha256(text.encode()).hexdigest()}"

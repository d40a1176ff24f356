"""The agents of a chaos run, started by the spawner as `chaos.agents:<function>`.

A manager spawns children (managers one level down, or workers), waits for each and reports
how they ended; a worker sleeps a little and answers. The task is JSON:
`{"depth": 2, "fanout": 3, "sleep": 0.2}`.
"""

from __future__ import annotations

import asyncio
import json

from agentgrove.context import AgentContext

#: Seconds a manager waits for one child before it reports that child as lost.
CHILD_WAIT_S = 120.0


async def manager(ctx: AgentContext) -> str:
    """Spawn `fanout` children one level down and wait for them; a depth of 0 is a worker."""
    spec = json.loads(ctx.task)
    depth, fanout, sleep = int(spec["depth"]), int(spec["fanout"]), float(spec["sleep"])
    if depth <= 0:
        await asyncio.sleep(sleep)
        return f"worker {ctx.agent_id} done"
    child_task = json.dumps({"depth": depth - 1, "fanout": fanout, "sleep": sleep})
    children = [
        await ctx.spawn_agent(child_task, entrypoint="chaos.agents:manager") for _ in range(fanout)
    ]
    await ctx.checkpoint(f"spawned {len(children)} children")
    ends = []
    for child in children:
        try:
            result = await ctx.wait(child, timeout=CHILD_WAIT_S)
        except TimeoutError:
            ends.append("lost")
        else:
            ends.append(result.reason)
    return ",".join(ends)

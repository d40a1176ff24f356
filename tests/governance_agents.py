"""Python agents of the message-rate and failure-notice tests, as
`tests.governance_agents:<function>`."""

from __future__ import annotations

import json
import time

from agentgrove.context import AgentContext
from grove_events import StatusEvent


async def receives(ctx: AgentContext) -> str:
    """Reads the number of inbox entries in its task; returns, as a JSON list, each one's text
    and the wall-clock time it was handed over."""
    arrivals = []
    for _ in range(int(ctx.task)):
        item = await ctx.next_message(timeout=60)
        arrivals.append([item.text, time.time()])
    return json.dumps(arrivals)


async def manages_a_failure(ctx: AgentContext) -> str:
    """Spawns a child that fails (`tests.lifecycle_agents:fails`), reads its inbox until the
    child's terminate, then waits on the child; returns, as JSON, what its inbox brought and
    what waiting gave."""
    child = await ctx.spawn_agent("open the door", entrypoint="tests.lifecycle_agents:fails")
    inbox = []
    while True:
        item = await ctx.next_message(timeout=60)
        event = item.event
        entry: dict[str, object] = {"type": item.type, "via": item.via, "source": item.source}
        if isinstance(event, StatusEvent):
            entry["status_type"] = event.status_type
            entry["details"] = event.payload.details
        inbox.append(entry)
        if item.type == "terminate" and item.source == child:
            break
    result = await ctx.wait(child, timeout=60)
    return json.dumps(
        {
            "child": child,
            "inbox": inbox,
            "waited": {
                "reason": result.reason,
                "error": result.error,
                "attempted": list(result.attempted),
                "partial_results": list(result.partial_results),
            },
        }
    )

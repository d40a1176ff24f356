"""The agents of a chaos run, started by the spawner as `chaos.agents:<function>`.

A manager spawns children (managers one level down, or workers), waits for each, reads what
its inbox holds and reports how they ended. A worker's role follows from its id (`role_of`):
it sleeps a little and answers, asks the caller a question (`ask_human`) and answers with the
reply, stores an artifact and reads it back, or sends its parent a message. The task is JSON:
`{"depth": 2, "fanout": 3, "sleep": 0.2}`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import zlib
from collections.abc import Awaitable, Callable
from typing import TypeVar

from agentgrove.artifacts import ArtifactError
from agentgrove.context import AgentContext
from agentgrove.routing import riding_out_restarts
from grove_events import new_id

T = TypeVar("T")

#: Seconds a manager waits for one child before it reports that child as lost.
CHILD_WAIT_S = 120.0
#: Seconds an asker waits for its answer (the scripted caller answers within a second or two).
ANSWER_WAIT_S = 150.0
ROLES = ("sleeper", "asker", "artifact", "messenger")
#: Attempts at an artifact put or get while the artifact-store restarts.
ARTIFACT_ATTEMPTS = 8


def role_of(agent_id: str) -> str:
    """A worker's role, the same for the driver's checks and the agent."""
    return ROLES[zlib.crc32(agent_id.encode()) % len(ROLES)]


def question_of(agent_id: str) -> str:
    """The question an asker asks."""
    return f"may {agent_id} go on?"


async def manager(ctx: AgentContext) -> str:
    """Spawn `fanout` children one level down and wait for them; a depth of 0 is a worker."""
    spec = json.loads(ctx.task)
    depth, fanout, sleep = int(spec["depth"]), int(spec["fanout"]), float(spec["sleep"])
    if depth <= 0:
        return await WORKERS[role_of(ctx.agent_id)](ctx, sleep)
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
    read = await riding_out_restarts(ctx.inbox)
    return ",".join(ends) + f"; inbox {len(read)}"


async def sleeper(ctx: AgentContext, sleep: float) -> str:
    await asyncio.sleep(sleep)
    return f"worker {ctx.agent_id} done"


async def asker(ctx: AgentContext, sleep: float) -> str:
    answer = await ctx.ask_human(
        question_of(ctx.agent_id), options=["yes", "no"], timeout=ANSWER_WAIT_S
    )
    return f"answer: {answer}"


async def artifact(ctx: AgentContext, sleep: float) -> str:
    """Store some bytes and read them back, each step tried again while the artifact-store
    restarts (the put under one put_id, so a put whose answer was lost is stored once)."""
    data = hashlib.sha256(ctx.agent_id.encode()).hexdigest() * 64
    put_id = new_id()
    stored = await _attempts(
        lambda: ctx.put_artifact(data, f"{ctx.agent_id}.txt", "text/plain", put_id=put_id)
    )
    read = await _attempts(lambda: ctx.get_artifact(stored.artifact_id))
    if read != data.encode():
        raise RuntimeError(f"artifact {stored.artifact_id} came back changed")
    return f"artifact {stored.artifact_id} {stored.sha256}"


async def _attempts(step: Callable[[], Awaitable[T]]) -> T:
    """`step`, tried again after an ArtifactError (up to ARTIFACT_ATTEMPTS times)."""
    for attempt in range(ARTIFACT_ATTEMPTS - 1):
        try:
            return await step()
        except ArtifactError:
            await asyncio.sleep(1.0 + attempt)
    return await step()


async def messenger(ctx: AgentContext, sleep: float) -> str:
    parent = ctx.parent
    if parent is None:
        return "no parent to tell"
    message_id = await ctx.send_message(f"hello from {ctx.agent_id}", to=parent)
    return f"told {parent} ({message_id})"


WORKERS = {"sleeper": sleeper, "asker": asker, "artifact": artifact, "messenger": messenger}

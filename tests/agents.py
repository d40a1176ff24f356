"""Small python-runtime agents the integration tests run, as `tests.agents:<function>`."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import nats

from agentgrove.context import AgentContext


async def quick(ctx: AgentContext) -> str:
    """Ends at once; its summary names it."""
    return f"done {ctx.agent_id}"


async def sleeper(ctx: AgentContext) -> str:
    """Sleeps for the number of seconds in its task (30 when the task is not a number)."""
    try:
        seconds = float(ctx.task)
    except ValueError:
        seconds = 30.0
    await asyncio.sleep(seconds)
    return "slept"


def _append_line(path: Path, line: str) -> None:
    with path.open("a") as out:
        out.write(line + "\n")


async def record_run(ctx: AgentContext) -> str:
    """Appends its agent id to a file, then sleeps; the task is `{"path": ..., "sleep": ...}`.

    Each line in the file is one run of an agent, so a test can count how often it ran.
    """
    spec = json.loads(ctx.task)
    await asyncio.to_thread(_append_line, Path(spec["path"]), ctx.agent_id)
    await asyncio.sleep(float(spec.get("sleep", 0)))
    return "recorded"


async def spawns_children(ctx: AgentContext) -> str:
    """Spawns the number of `quick` children in its task, waits for them, lists their ends."""
    count = int(ctx.task)
    children = [
        await ctx.spawn_agent(f"child {i}", entrypoint="tests.agents:quick") for i in range(count)
    ]
    results = [await ctx.wait(child, timeout=60) for child in children]
    return ",".join(result.reason for result in results)


async def probe_credentials() -> dict[str, object]:
    """Run as a command agent: which NATS user its environment names, whether the spawner's
    password reached it, and what that user may publish (a terminate: no; a request: yes)."""
    denied: list[str] = []

    async def on_error(exc: Exception) -> None:
        denied.append(str(exc))

    nc = await nats.connect(
        os.environ["GROVE_NATS_URL"],
        user=os.environ.get("GROVE_NATS_USER"),
        password=os.environ.get("GROVE_NATS_PASSWORD"),
        error_cb=on_error,
        allow_reconnect=False,
    )
    try:
        await nc.publish(f"grove.terminate.{os.environ['GROVE_AGENT_ID']}", b"{}")
        await nc.flush()
        await asyncio.sleep(0.5)
        terminate_denied = any("permissions violation" in d.lower() for d in denied)
        denied.clear()
        await nc.publish("grove.rpc.governor.status", b"{}")
        await nc.flush()
        await asyncio.sleep(0.5)
    finally:
        await nc.close()
    return {
        "user": os.environ.get("GROVE_NATS_USER"),
        "url_has_user": "@" in os.environ["GROVE_NATS_URL"],
        "terminate_denied": terminate_denied,
        "request_allowed": not denied,
    }


def probe_credentials_main() -> None:
    """The entry point of the command agent above: prints what it found as JSON."""
    print(json.dumps(asyncio.run(probe_credentials())))

"""A large GROVE log made fast: the events of one agent's lifecycle, encoded once as templates
by the events library, then stamped with fresh ids for each agent and published pipelined.

Each agent contributes five events: spawn, status admitted, status started, status completed,
terminate completed. Agents come in families: a root and `FAMILY - 1` children of it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

from nats.js import api as js_api

from grove_core.log import EventLog
from grove_core.records import RawRecord
from grove_events import (
    AgentConfig,
    Event,
    ResultSummary,
    SpawnEvent,
    StatusEvent,
    StatusPayload,
    TerminateEvent,
    Usage,
    encode,
    subject_for,
)

EVENTS_PER_AGENT = 5
FAMILY = 10
_AGENT = "AGENTxxxxxxxxxxxxxxxx"
_PARENT = "PARENTxxxxxxxxxxxxxxx"
_EVENT = "EVENTxxxxxxxxxxxxxxx"
_MSG_ID = js_api.Header.MSG_ID.value
BENCH_SPAWNER = "bench-spawner"


def agent_id(index: int) -> str:
    """The id of the `index`th generated agent."""
    return f"agent-{index:012d}"


def _lifecycle(parent: str | None, *, running_only: bool) -> list[Event]:
    now = datetime.now(UTC)
    spawn_id = f"{_EVENT}0"
    config = AgentConfig(runtime="python", entrypoint="bench.agents:trivial")
    events: list[Event] = [
        SpawnEvent(
            event_id=spawn_id,
            agent_id=_AGENT,
            tree_id=None if parent else _AGENT,
            timestamp=now,
            task="summarise the benchmark's input",
            parent=parent,
            config=config,
        ),
        StatusEvent(
            event_id=f"{_EVENT}1",
            agent_id=_AGENT,
            timestamp=now,
            causation_id=spawn_id,
            status_type="admitted",
            payload=StatusPayload(summary="admitted (spawn)", details={"start": "spawn"}),
        ),
        StatusEvent(
            event_id=f"{_EVENT}2",
            agent_id=_AGENT,
            timestamp=now,
            causation_id=spawn_id,
            status_type="started",
            payload=StatusPayload(
                summary="started on python",
                details={"spawner_id": BENCH_SPAWNER, "runtime": "python", "start": "spawn"},
            ),
        ),
    ]
    if not running_only:
        events += [
            StatusEvent(
                event_id=f"{_EVENT}3",
                agent_id=_AGENT,
                timestamp=now,
                causation_id=spawn_id,
                status_type="completed",
                payload=StatusPayload(summary="ok"),
            ),
            TerminateEvent(
                event_id=f"{_EVENT}4",
                agent_id=_AGENT,
                timestamp=now,
                causation_id=spawn_id,
                reason="completed",
                result=ResultSummary(summary="ok"),
                usage=Usage(tokens=12, runtime_s=0.001),
            ),
        ]
    return events


class Lifecycles:
    """Encoded lifecycles of generated agents, as (subject, body, msg id) triples."""

    def __init__(self, *, running_only: bool = False, family: int = FAMILY) -> None:
        self.family = family
        self._root = [(e.type, encode(e)) for e in _lifecycle(None, running_only=running_only)]
        self._child = [(e.type, encode(e)) for e in _lifecycle(_PARENT, running_only=running_only)]

    def messages(self, index: int) -> Iterator[tuple[str, bytes, str]]:
        """The messages of agent `index` (a root every `family` agents, else its child)."""
        agent = agent_id(index)
        root = index - index % self.family
        templates = self._root if root == index else self._child
        agent_bytes = agent.encode()
        parent_bytes = agent_id(root).encode()
        for step, (kind, body) in enumerate(templates):
            event_id = f"ev-{index:012d}-{step}"
            data = (
                body.replace(_AGENT.encode(), agent_bytes)
                .replace(_PARENT.encode(), parent_bytes)
                .replace(_EVENT.encode(), f"ev-{index:012d}-".encode())
            )
            yield subject_for(kind, agent), data, event_id

    def records(self, agents: int, first_seq: int = 1) -> Iterator[RawRecord]:
        """The messages of `agents` agents as stored records, for folds without a server."""
        seq = first_seq
        stamp = datetime.now(UTC)
        for index in range(agents):
            for subject, data, _ in self.messages(index):
                yield RawRecord(seq=seq, subject=subject, data=data, timestamp=stamp)
                seq += 1


async def publish_log(log: EventLog, events: int, window: int = 4000) -> dict[str, Any]:
    """Append about `events` events (whole lifecycles) pipelined; returns the append rate."""
    lifecycles = Lifecycles()
    agents = max(1, events // EVENTS_PER_AGENT)
    pending: list[asyncio.Future[Any]] = []
    started = time.perf_counter()
    count = 0
    for index in range(agents):
        for subject, data, msg_id in lifecycles.messages(index):
            pending.append(await log.js.publish_async(subject, data, headers={_MSG_ID: msg_id}))
            count += 1
        if len(pending) >= window:
            await asyncio.wait_for(asyncio.gather(*pending), 60)
            pending.clear()
    await asyncio.wait_for(asyncio.gather(*pending), 60)
    elapsed = time.perf_counter() - started
    return {
        "events": count,
        "agents": agents,
        "seconds": round(elapsed, 3),
        "events_per_s": round(count / elapsed, 1),
    }

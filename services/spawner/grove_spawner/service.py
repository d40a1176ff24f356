"""The spawner's application layer: start admitted agents once, run them, report their end.

Replicas share one durable consumer of status events. For each `admitted` status a replica
appends `started` guarded by the admitted event's sequence, so exactly one replica starts the
agent even when the admission is delivered twice. Stops arrive as control events.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from dataclasses import dataclass
from datetime import UTC, datetime

from pydantic import Field

from agentgrove.context import AgentContext
from grove_core import metrics
from grove_core.log import (
    ConcurrencyConflict,
    Delivery,
    DurableConsumer,
    EventLog,
    Recorded,
    decode_record,
)
from grove_core.projection import ProjectionRunner, ProjectionStore
from grove_core.service import Service, run_service
from grove_core.settings import ServiceSettings
from grove_events import (
    ControlEvent,
    InvalidEvent,
    ResultSummary,
    SpawnEvent,
    StatusEvent,
    StatusPayload,
    TerminateEvent,
    Usage,
    new_id,
    subject_for,
)
from grove_spawner.domain import SPAWNER_ID_DETAIL, SpawnerState, evolve
from grove_spawner.runtimes import RUNTIMES, Outcome

log = logging.getLogger(__name__)

NAME = "spawner"
DURABLE = "spawner"


class SpawnerSettings(ServiceSettings):
    """Spawner settings; `GROVE_SPAWNER_ID` must be stable across restarts of one replica."""

    spawner_id: str = Field(default_factory=socket.gethostname)


@dataclass
class RunningAgent:
    """An agent this process is running."""

    spawn: SpawnEvent
    tree_id: str
    task: asyncio.Task[None] | None = None
    stop_reason: str | None = None
    started_at: float = 0.0


def cut_to_budget(text: str, budget: int) -> tuple[str, bool]:
    """The summary within `budget` characters, and whether it was cut."""
    if len(text) <= budget:
        return text, False
    return text[:budget], True


class Spawner:
    """Runs admitted agents on their runtimes."""

    def __init__(
        self, event_log: EventLog, store: ProjectionStore, spawner_id: str, nats_url: str
    ) -> None:
        self.log = event_log
        self.spawner_id = spawner_id
        self.nats_url = nats_url
        self.running: dict[str, RunningAgent] = {}
        self.consumer = DurableConsumer(event_log, DURABLE, subject_for("status", "*"))
        self.runner: ProjectionRunner[SpawnerState] = ProjectionRunner(
            name=f"spawner-{spawner_id}",
            log=event_log,
            store=store,
            state_type=SpawnerState,
            evolve=evolve,
            on_caught_up=self.fail_lost_agents,
        )

    # -- starting ----------------------------------------------------------------------------

    async def on_status(self, delivery: Delivery) -> None:
        """Handle one status from the shared durable consumer."""
        try:
            recorded = decode_record(delivery.record)
        except InvalidEvent:
            await delivery.ack()  # the projection runner dead-letters it
            return
        event = recorded.event
        if isinstance(event, StatusEvent) and event.status_type == "admitted":
            await self.start(recorded, event)
        await delivery.ack()

    async def start(self, admitted: Recorded, status: StatusEvent) -> None:
        """Start an admitted agent, unless another replica already did."""
        agent_id = status.agent_id
        if agent_id in self.running:
            return
        raw = await self.log.get_last(subject_for("spawn", agent_id))
        if raw is None:
            log.error("admitted agent %s has no spawn event; ignoring", agent_id)
            return
        spawn = decode_record(raw).event
        assert isinstance(spawn, SpawnEvent)
        tree_id = status.tree_id or spawn.tree_id or agent_id
        agent = RunningAgent(spawn=spawn, tree_id=tree_id)
        self.running[agent_id] = agent
        try:
            await self.log.append(
                StatusEvent(
                    event_id=new_id(),
                    agent_id=agent_id,
                    session_id=spawn.session_id,
                    tree_id=tree_id,
                    timestamp=datetime.now(UTC),
                    causation_id=status.event_id,
                    status_type="started",
                    payload=StatusPayload(
                        summary=f"started on {spawn.config.runtime}",
                        details={
                            SPAWNER_ID_DETAIL: self.spawner_id,
                            "runtime": spawn.config.runtime,
                        },
                    ),
                ),
                expect_last_seq=admitted.seq,
            )
        except ConcurrencyConflict:
            self.running.pop(agent_id, None)
            log.info("%s was started elsewhere", agent_id)
            return
        if spawn.timestamp is not None:
            metrics.SPAWN_TO_STARTED.observe(
                max(0.0, (datetime.now(UTC) - spawn.timestamp).total_seconds())
            )
        agent.started_at = time.monotonic()
        stop = await self.log.get_last(subject_for("control", agent_id))
        if stop is not None:
            with contextlib.suppress(InvalidEvent):
                control = decode_record(stop).event
                if isinstance(control, ControlEvent) and control.action == "stop":
                    agent.stop_reason = control.reason or "stopped"
        if agent.stop_reason is not None:
            self.running.pop(agent_id, None)
            await self._terminate(agent, "stopped", summary=agent.stop_reason)
            return
        agent.task = asyncio.create_task(self._run(agent), name=f"agent-{agent_id}")

    async def _run(self, agent: RunningAgent) -> None:
        spawn = agent.spawn
        runtime = RUNTIMES.get(spawn.config.runtime)
        context = AgentContext(self.log, spawn, agent.tree_id)
        env = {
            "GROVE_AGENT_ID": spawn.agent_id,
            "GROVE_TREE_ID": agent.tree_id,
            "GROVE_NATS_URL": self.nats_url,
        }
        try:
            if runtime is None:
                outcome = Outcome(
                    completed=False,
                    error=f"runtime {spawn.config.runtime!r} is not available in this spawner "
                    f"(available: {', '.join(RUNTIMES)})",
                )
            else:
                outcome = await runtime.run(spawn, context, env)
        except asyncio.CancelledError:
            await self._terminate(agent, "stopped", summary=agent.stop_reason or "stopped")
            return
        except Exception as exc:
            log.exception("runtime crashed for %s", spawn.agent_id)
            outcome = Outcome(completed=False, error=f"runtime error: {exc!r}")
        finally:
            self.running.pop(spawn.agent_id, None)
        if outcome.completed:
            await self._terminate(
                agent, "completed", summary=outcome.summary, tokens=outcome.tokens
            )
        else:
            metrics.RUNTIME_ERRORS.labels(spawn.config.runtime).inc()
            await self._report_failure(agent, outcome)
            await self._terminate(agent, "failed", error=outcome.error, tokens=outcome.tokens)

    async def _report_failure(self, agent: RunningAgent, outcome: Outcome) -> None:
        spawn = agent.spawn
        await self.log.append(
            StatusEvent(
                event_id=new_id(),
                agent_id=spawn.agent_id,
                session_id=spawn.session_id,
                tree_id=agent.tree_id,
                timestamp=datetime.now(UTC),
                causation_id=spawn.event_id,
                status_type="failed",
                payload=StatusPayload(
                    summary=(outcome.error or "failed")[:500],
                    details={
                        "error": outcome.error,
                        "attempted": outcome.attempted,
                        "partial_results": outcome.partial_results,
                    },
                ),
            )
        )

    async def _terminate(
        self,
        agent: RunningAgent,
        reason: str,
        *,
        summary: str = "",
        error: str | None = None,
        tokens: int = 0,
    ) -> None:
        spawn = agent.spawn
        text, truncated = cut_to_budget(summary, spawn.config.return_budget)
        runtime_s = time.monotonic() - agent.started_at if agent.started_at else 0.0
        try:
            await self.log.append(
                TerminateEvent(
                    event_id=new_id(),
                    agent_id=spawn.agent_id,
                    session_id=spawn.session_id,
                    tree_id=agent.tree_id,
                    timestamp=datetime.now(UTC),
                    causation_id=spawn.event_id,
                    reason=reason,
                    result=ResultSummary(summary=text, truncated=truncated),
                    error=error,
                    usage=Usage(tokens=tokens, runtime_s=round(runtime_s, 6)),
                ),
                expect_last_seq=0,
            )
        except ConcurrencyConflict:
            log.info("%s was already terminated", spawn.agent_id)

    # -- stopping ----------------------------------------------------------------------------

    async def follow_controls(self) -> None:
        """Act on stop controls for the agents this process runs."""
        tip = await self.log.last_seq()
        async for item in self.log.events(
            tip + 1, subjects=subject_for("control", "*"), follow=True
        ):
            if not isinstance(item, Recorded):
                continue
            event = item.event
            if isinstance(event, ControlEvent) and event.action == "stop":
                agent = self.running.get(event.agent_id)
                if agent is not None and agent.task is not None and agent.stop_reason is None:
                    agent.stop_reason = event.reason or "stopped"
                    agent.task.cancel()
                elif agent is not None:
                    agent.stop_reason = event.reason or "stopped"

    # -- recovery ----------------------------------------------------------------------------

    async def fail_lost_agents(self) -> None:
        """After a restart: agents this spawner started before are gone; say so."""
        for started in self.runner.state.started_by(self.spawner_id):
            if started.agent_id in self.running:
                continue
            await self._terminate_lost(started.agent_id, started.tree_id)

    async def _terminate_lost(self, agent_id: str, tree_id: str | None) -> None:
        error = f"spawner {self.spawner_id} restarted; the agent's run was lost"
        try:
            await self.log.append(
                TerminateEvent(
                    event_id=new_id(),
                    agent_id=agent_id,
                    tree_id=tree_id,
                    timestamp=datetime.now(UTC),
                    reason="failed",
                    error=error,
                ),
                expect_last_seq=0,
            )
        except ConcurrencyConflict:
            return
        log.warning("%s: %s", agent_id, error)

    async def shutdown(self) -> None:
        """Stop every running agent (they end as stopped)."""
        for agent in list(self.running.values()):
            if agent.task is not None:
                agent.stop_reason = agent.stop_reason or f"spawner {self.spawner_id} shut down"
                agent.task.cancel()
        tasks = [a.task for a in self.running.values() if a.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=10)


async def setup(service: Service) -> None:
    """Start a spawner inside a service process."""
    assert service.log is not None
    settings = SpawnerSettings()
    store = ProjectionStore(settings.database_for(f"spawner-{settings.spawner_id}"))
    spawner = Spawner(service.log, store, settings.spawner_id, settings.nats_url)
    service.ready_checks.append(spawner.runner.caught_up.is_set)
    service.spawn(spawner.runner.run(), "spawner-projection")
    await spawner.runner.caught_up.wait()
    await spawner.consumer.start()
    service.spawn(spawner.consumer.run(spawner.on_status, service.stop_event), "spawner-consumer")
    service.spawn(spawner.follow_controls(), "spawner-controls")
    service.on_stop.append(spawner.shutdown)


def main() -> None:
    """`python -m grove_spawner`."""
    run_service(NAME, setup, SpawnerSettings())

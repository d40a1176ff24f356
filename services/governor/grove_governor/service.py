"""The resource-governor's application layer: fold the log, append its decisions, answer
`get_resource_status` over request-reply."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from datetime import UTC, datetime
from typing import Any

from nats.aio.msg import Msg
from pydantic import Field

from grove_core import metrics
from grove_core.config import load_config
from grove_core.log import ConcurrencyConflict, EventLog, Recorded
from grove_core.projection import ProjectionRunner, ProjectionStore
from grove_core.service import Service, run_service
from grove_core.settings import ServiceSettings
from grove_events import (
    ResourceLimits,
    ResultSummary,
    StatusEvent,
    StatusPayload,
    TerminateEvent,
    new_id,
    rpc_subject,
    subject_for,
)
from grove_governor.domain import (
    DEFAULT_GRACE_S,
    Admit,
    AgentSlot,
    Cancel,
    Decision,
    Finish,
    GovernorState,
    InFlight,
    Notice,
    Queue,
    Reject,
    TimeOut,
    decide,
    effective_parent_limits,
    evolve,
    resource_status,
)

log = logging.getLogger(__name__)

NAME = "governor"
STATUS_SUBJECT = rpc_subject("governor", "status")


class GovernorSettings(ServiceSettings):
    """Governor settings."""

    timeout_grace: float = Field(
        default=DEFAULT_GRACE_S, gt=0, description="Seconds from timeout_notice to the stop."
    )
    tick_interval: float = Field(default=0.25, gt=0, description="Seconds between clock checks.")


class Governor:
    """Admits, queues or rejects spawns under the limits, and stops agents over them."""

    def __init__(
        self,
        event_log: EventLog,
        store: ProjectionStore,
        limits: ResourceLimits,
        *,
        grace_s: float = DEFAULT_GRACE_S,
    ) -> None:
        self.log = event_log
        self.limits = limits
        self.grace_s = grace_s
        self.in_flight: dict[str, InFlight] = {}
        self._acting = asyncio.Lock()
        self.runner: ProjectionRunner[GovernorState] = ProjectionRunner(
            name=NAME,
            log=event_log,
            store=store,
            state_type=GovernorState,
            evolve=evolve,
            after_event=self._after_event,
            on_caught_up=self.act,
        )

    @property
    def state(self) -> GovernorState:
        """The current fold."""
        return self.runner.state

    async def _after_event(self, recorded: Recorded, live: bool) -> None:
        if recorded.event.type in ("status", "terminate"):
            self.in_flight.pop(recorded.event.agent_id, None)
        if live:
            await self.act()

    async def tick(self, interval: float) -> None:
        """Act on the clock: queued admissions and runtime limits need time to pass."""
        await self.runner.caught_up.wait()
        while True:
            await asyncio.sleep(interval)
            await self.act()

    async def act(self) -> None:
        """Append whatever the state calls for now."""
        async with self._acting:
            decisions = decide(self.state, self.limits, time.time(), self.in_flight, self.grace_s)
            for decision in decisions:
                slot = self.state.agents[decision.agent_id]
                self.in_flight[decision.agent_id] = InFlight(
                    slot.status_seq, slot.terminate_seq, isinstance(decision, Admit)
                )
            for decision in decisions:
                try:
                    await self._append(decision)
                except ConcurrencyConflict:
                    log.info("decision for %s already taken elsewhere", decision.agent_id)
            self._update_gauges()

    def _update_gauges(self) -> None:
        counts: dict[str, int] = {}
        for slot in self.state.agents.values():
            counts[slot.phase] = counts.get(slot.phase, 0) + 1
        for phase in ("pending", "queued", "admitted", "running", "ended"):
            metrics.AGENTS.labels(NAME, phase).set(counts.get(phase, 0))
        metrics.QUEUE_DEPTH.set(counts.get("queued", 0) + counts.get("pending", 0))

    def _status(
        self, slot: AgentSlot, status_type: str, summary: str = "", **details: Any
    ) -> StatusEvent:
        return StatusEvent(
            event_id=new_id(),
            agent_id=slot.agent_id,
            tree_id=slot.tree_id,
            timestamp=datetime.now(UTC),
            causation_id=slot.cause,
            status_type=status_type,
            payload=StatusPayload(summary=summary, details=details),
        )

    async def _append(self, decision: Decision) -> None:
        slot = self.state.agents.get(decision.agent_id)
        if slot is None:
            return
        status_subject = subject_for("status", slot.agent_id)
        match decision:
            case Admit(start=start, message=message):
                parent = self.state.agents.get(slot.parent) if slot.parent else None
                parent_rate = effective_parent_limits(
                    self.state, self.limits, parent
                ).max_spawn_rate
                event = self._status(
                    slot,
                    "admitted",
                    f"admitted ({start})",
                    start=start,
                    message=message,
                    global_rate=self.limits.global_.max_spawn_rate,
                    parent_rate=parent_rate,
                )
                await self.log.append(
                    event, expect_last_seq=decision.expect_status_seq, expect_subject=status_subject
                )
                metrics.SPAWNS.labels("admitted").inc()
            case Queue(why=why):
                await self.log.append(
                    self._status(slot, "queued", why),
                    expect_last_seq=decision.expect_status_seq,
                    expect_subject=status_subject,
                )
                metrics.SPAWNS.labels("queued").inc()
            case Reject(error=error):
                await self.log.append(
                    self._status(slot, "rejected", error),
                    expect_last_seq=decision.expect_status_seq,
                    expect_subject=status_subject,
                )
                metrics.SPAWNS.labels("rejected").inc()
                await self._terminate(slot, "rejected", error, slot.terminate_seq)
            case Cancel(why=why):
                await self.log.append(
                    self._status(slot, "stopped", why),
                    expect_last_seq=decision.expect_status_seq,
                    expect_subject=status_subject,
                )
                await self._terminate(slot, "cancelled", why, slot.terminate_seq)
            case Finish(reason=reason, error=error, expect_terminate_seq=seq):
                await self._terminate(slot, reason, error, seq)
            case Notice(why=why):
                await self.log.append(
                    self._status(slot, "timeout_notice", why, grace_s=self.grace_s)
                )
            case TimeOut(why=why, expect_terminate_seq=seq):
                await self._terminate(slot, "timeout", why, seq)

    async def _terminate(self, slot: AgentSlot, reason: str, error: str, expect: int) -> None:
        try:
            await self.log.append(
                TerminateEvent(
                    event_id=new_id(),
                    agent_id=slot.agent_id,
                    tree_id=slot.tree_id,
                    timestamp=datetime.now(UTC),
                    causation_id=slot.cause,
                    reason=reason,
                    error=error,
                    result=ResultSummary(summary=error),
                ),
                expect_last_seq=expect,
            )
        except ConcurrencyConflict:
            log.info("%s already terminated", slot.agent_id)

    async def serve_status(self, msg: Msg) -> None:
        """`grove.rpc.governor.status`: {"agent_id"?} -> the resource status."""
        agent_id = None
        try:
            request = json.loads(msg.data or b"{}")
            if isinstance(request, dict) and isinstance(request.get("agent_id"), str):
                agent_id = request["agent_id"]
        except json.JSONDecodeError:
            await msg.respond(json.dumps({"error": "request must be JSON"}).encode())
            return
        answer = resource_status(self.state, self.limits, agent_id, time.time())
        if agent_id is not None and "self" not in answer:
            answer["error"] = f"unknown agent {agent_id!r}"
        await msg.respond(json.dumps(answer).encode())


async def setup(service: Service) -> None:
    """Start the governor inside a service process."""
    assert service.log is not None
    settings = GovernorSettings()
    config = load_config(settings.config_path())
    store = ProjectionStore(settings.database_for(NAME))
    governor = Governor(service.log, store, config.resources, grace_s=settings.timeout_grace)
    service.ready_checks.append(governor.runner.caught_up.is_set)
    service.spawn(governor.runner.run(), "governor-projection")
    service.spawn(governor.tick(settings.tick_interval), "governor-clock")
    await governor.runner.caught_up.wait()
    await service.log.nc.subscribe(STATUS_SUBJECT, cb=governor.serve_status)


def main() -> None:
    """`python -m grove_governor`."""
    run_service(NAME, setup, GovernorSettings())

"""The resource-governor's application layer: fold the log, append its decisions."""

from __future__ import annotations

import logging
from datetime import UTC, datetime

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
    subject_for,
)
from grove_governor.domain import (
    Admit,
    Decision,
    FinishRejection,
    GovernorState,
    InFlight,
    Reject,
    decide,
    evolve,
)

log = logging.getLogger(__name__)

NAME = "governor"


class Governor:
    """Admits or rejects spawns under the configured limits; every decision is an event."""

    def __init__(self, event_log: EventLog, store: ProjectionStore, limits: ResourceLimits) -> None:
        self.log = event_log
        self.limits = limits
        self.in_flight: dict[str, InFlight] = {}
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

    async def act(self) -> None:
        """Append whatever the state calls for now."""
        decisions = decide(self.state, self.limits, self.in_flight)
        for decision in decisions:
            slot = self.state.agents[decision.agent_id]
            self.in_flight[decision.agent_id] = InFlight(
                slot.status_seq, isinstance(decision, Admit)
            )
        for decision in decisions:
            try:
                await self._append(decision)
            except ConcurrencyConflict:
                log.info("decision for %s already taken elsewhere", decision.agent_id)

    async def _append(self, decision: Decision) -> None:
        slot = self.state.agents.get(decision.agent_id)
        if slot is None:
            return
        now = datetime.now(UTC)
        envelope = {
            "agent_id": slot.agent_id,
            "tree_id": slot.tree_id,
            "timestamp": now,
            "causation_id": slot.cause,
        }
        status_subject = subject_for("status", slot.agent_id)
        if isinstance(decision, Admit):
            await self.log.append(
                StatusEvent(event_id=new_id(), status_type="admitted", **envelope),
                expect_last_seq=decision.expect_status_seq,
                expect_subject=status_subject,
            )
            metrics.SPAWNS.labels("admitted").inc()
        elif isinstance(decision, Reject):
            await self.log.append(
                StatusEvent(
                    event_id=new_id(),
                    status_type="rejected",
                    payload=StatusPayload(summary=decision.error),
                    **envelope,
                ),
                expect_last_seq=decision.expect_status_seq,
                expect_subject=status_subject,
            )
            metrics.SPAWNS.labels("rejected").inc()
            await self._terminate_rejected(slot.agent_id, envelope, decision.error)
        elif isinstance(decision, FinishRejection):
            await self._terminate_rejected(slot.agent_id, envelope, decision.error)

    async def _terminate_rejected(
        self, agent_id: str, envelope: dict[str, object], error: str
    ) -> None:
        try:
            await self.log.append(
                TerminateEvent(
                    event_id=new_id(),
                    reason="rejected",
                    error=error,
                    result=ResultSummary(summary=error),
                    **envelope,
                ),
                expect_last_seq=0,
            )
        except ConcurrencyConflict:
            log.info("%s already terminated", agent_id)


async def setup(service: Service) -> None:
    """Start the governor inside a service process."""
    assert service.log is not None
    settings = service.settings
    config = load_config(settings.config_path())
    store = ProjectionStore(settings.database_for(NAME))
    governor = Governor(service.log, store, config.resources)
    service.ready_checks.append(governor.runner.caught_up.is_set)
    service.spawn(governor.runner.run(), "governor-projection")


def main() -> None:
    """`python -m grove_governor`."""
    run_service(NAME, setup, ServiceSettings())

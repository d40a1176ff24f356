"""The resource-governor's application layer: fold the log, append its decisions, answer
`get_resource_status` over request-reply."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from prometheus_client import Counter
from pydantic import Field

from grove_core import metrics
from grove_core.config import load_config
from grove_core.log import Append, ConcurrencyConflict, EventLog, LogError
from grove_core.projection import ProjectionRunner, ProjectionStore
from grove_core.records import Recorded
from grove_core.rpc import RpcServer
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
    FOLD_VERSION,
    FOLDED_KINDS,
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

APPEND_FAILURES = Counter(
    "grove_governor_append_failures_total",
    "Rounds of decisions the log refused or did not acknowledge (retried on the next tick).",
)

NAME = "governor"
STATUS_SUBJECT = rpc_subject("governor", "status")


class GovernorSettings(ServiceSettings):
    """Governor settings."""

    timeout_grace: float = Field(
        default=DEFAULT_GRACE_S, gt=0, description="Seconds from timeout_notice to the stop."
    )
    tick_interval: float = Field(default=0.25, gt=0, description="Seconds between clock checks.")


@dataclass(frozen=True, slots=True)
class Plan:
    """The appends of one decision: `first`, then `then` if `first` was not a lost race."""

    agent_id: str
    first: Append
    then: Append | None = None
    #: The spawn outcome `first` counts as in the metrics.
    counted: str | None = None


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
        self._wake = asyncio.Event()
        self.runner: ProjectionRunner[GovernorState] = ProjectionRunner(
            name=NAME,
            log=event_log,
            store=store,
            state_type=GovernorState,
            evolve=evolve,
            after_event=self._after_event,
            on_caught_up=self.act,
            kinds=FOLDED_KINDS,
            fold_version=FOLD_VERSION,
        )

    @property
    def state(self) -> GovernorState:
        """The current fold."""
        return self.runner.state

    async def _after_event(self, recorded: Recorded, live: bool) -> None:
        if recorded.event.type in ("status", "terminate"):
            self.in_flight.pop(recorded.event.agent_id, None)
        if live:
            self._wake.set()

    async def react(self) -> None:
        """Act whenever live events arrive, without holding up the fold: events that arrive
        while a round of decisions is being appended are decided together in the next one."""
        await self.runner.caught_up.wait()
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self.act(check_limits=False)

    async def tick(self, interval: float) -> None:
        """Act on the clock: queued admissions and runtime limits need time to pass."""
        await self.runner.caught_up.wait()
        while True:
            await asyncio.sleep(interval)
            await self.act()

    async def act(self, *, check_limits: bool = True) -> None:
        """Append whatever the state calls for now, all decisions of a round pipelined.

        Runtime and token limits are checked on the clock (`check_limits`), not for every event.
        """
        async with self._acting:
            decisions = decide(
                self.state,
                self.limits,
                time.time(),
                self.in_flight,
                self.grace_s,
                check_limits=check_limits,
            )
            for decision in decisions:
                slot = self.state.agents[decision.agent_id]
                self.in_flight[decision.agent_id] = InFlight(
                    slot.status_seq, slot.terminate_seq, isinstance(decision, Admit)
                )
            plans = [self._plan(decision) for decision in decisions]
            try:
                firsts = await self.log.append_batch([plan.first for plan in plans])
            except LogError as exc:
                self._retry_later(decisions, exc)
                return
            then = []
            for plan, outcome in zip(plans, firsts, strict=True):
                if isinstance(outcome, ConcurrencyConflict):
                    log.info("decision for %s already taken elsewhere", plan.agent_id)
                    continue
                if plan.counted is not None:
                    metrics.SPAWNS.labels(plan.counted).inc()
                if plan.then is not None:
                    then.append(plan.then)
            try:
                thens = await self.log.append_batch(then)
            except LogError as exc:
                self._retry_later(decisions, exc)
                return
            for append, outcome in zip(then, thens, strict=True):
                if isinstance(outcome, ConcurrencyConflict):
                    log.info("%s already terminated", append.event.agent_id)
            self._update_gauges()

    def _retry_later(self, decisions: list[Decision], exc: LogError) -> None:
        """The log refused or did not acknowledge a round: decide again on the next tick.

        Every decision is guarded by the sequence it was decided at, so a round that did land
        in part is not decided twice: the part that landed wins, the retry loses its guard.
        """
        for decision in decisions:
            self.in_flight.pop(decision.agent_id, None)
        APPEND_FAILURES.inc()
        log.warning("could not append %d decisions, retrying: %s", len(decisions), exc)

    def _update_gauges(self) -> None:
        counts = self.state.phases
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

    def _guarded_status(
        self, slot: AgentSlot, expect: int, status_type: str, summary: str, **details: Any
    ) -> Append:
        return Append(
            self._status(slot, status_type, summary, **details),
            expect_last_seq=expect,
            expect_subject=subject_for("status", slot.agent_id),
        )

    def _plan(self, decision: Decision) -> Plan:
        slot = self.state.agents[decision.agent_id]
        match decision:
            case Admit(start=start, message=message, expect_status_seq=seq):
                parent = self.state.agents.get(slot.parent) if slot.parent else None
                parent_rate = effective_parent_limits(
                    self.state, self.limits, parent
                ).max_spawn_rate
                admitted = self._guarded_status(
                    slot,
                    seq,
                    "admitted",
                    f"admitted ({start})",
                    start=start,
                    message=message,
                    global_rate=self.limits.global_.max_spawn_rate,
                    parent_rate=parent_rate,
                )
                return Plan(slot.agent_id, admitted, counted="admitted")
            case Queue(why=why, expect_status_seq=seq):
                return Plan(
                    slot.agent_id, self._guarded_status(slot, seq, "queued", why), counted="queued"
                )
            case Reject(error=error, expect_status_seq=seq):
                return Plan(
                    slot.agent_id,
                    self._guarded_status(slot, seq, "rejected", error),
                    then=self._terminate(slot, "rejected", error, slot.terminate_seq),
                    counted="rejected",
                )
            case Cancel(why=why, expect_status_seq=seq):
                return Plan(
                    slot.agent_id,
                    self._guarded_status(slot, seq, "stopped", why),
                    then=self._terminate(slot, "cancelled", why, slot.terminate_seq),
                )
            case Finish(reason=reason, error=error, expect_terminate_seq=seq):
                return Plan(slot.agent_id, self._terminate(slot, reason, error, seq))
            case Notice(why=why):
                notice = self._status(slot, "timeout_notice", why, grace_s=self.grace_s)
                return Plan(slot.agent_id, Append(notice))
            case TimeOut(why=why, expect_terminate_seq=seq):
                return Plan(slot.agent_id, self._terminate(slot, "timeout", why, seq))

    def _terminate(self, slot: AgentSlot, reason: str, error: str, expect: int) -> Append:
        return Append(
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

    async def status(self, request: dict[str, Any]) -> dict[str, Any]:
        """`grove.rpc.governor.status`: {"agent_id"?} -> the resource status."""
        agent_id = request.get("agent_id")
        if not isinstance(agent_id, str):
            agent_id = None
        answer = resource_status(self.state, self.limits, agent_id, time.time())
        if agent_id is not None and "self" not in answer:
            answer["error"] = f"unknown agent {agent_id!r}"
        return answer


async def setup(service: Service) -> None:
    """Start the governor inside a service process."""
    assert service.log is not None
    settings = GovernorSettings()
    config = load_config(settings.config_path())
    store = ProjectionStore(settings.database_for(NAME))
    governor = Governor(service.log, store, config.resources, grace_s=settings.timeout_grace)
    service.ready_checks.append(governor.runner.ready)
    rpc = RpcServer(NAME, {"status": governor.status})
    service.ready_checks.append(rpc.is_serving)
    service.spawn(governor.runner.run(), "governor-projection")
    service.spawn(governor.tick(settings.tick_interval), "governor-clock")
    service.spawn(governor.react(), "governor-react")
    await governor.runner.caught_up.wait()
    await service.serve_rpc(rpc)


def main() -> None:
    """`python -m grove_governor`."""
    run_service(NAME, setup, GovernorSettings())

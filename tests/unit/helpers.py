"""Builders of recorded events for the pure fold tests."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from grove_core.records import Recorded
from grove_events import (
    AgentConfig,
    ArtifactEvent,
    ControlEvent,
    ForkEvent,
    SpawnEvent,
    StatusEvent,
    StatusPayload,
    TerminateEvent,
    new_id,
    subject_for,
)

T0 = datetime(2026, 1, 1, tzinfo=UTC)


class Log:
    """A growing list of recorded events with stream sequences, as the log would give them."""

    def __init__(self) -> None:
        self.records: list[Recorded] = []

    def add(self, event: Any) -> Recorded:
        # Stored when it was made, as far as these tests are concerned.
        recorded = Recorded(
            len(self.records) + 1,
            subject_for(event.type, event.agent_id),
            event,
            event.timestamp,
        )
        self.records.append(recorded)
        return recorded

    def spawn(
        self,
        agent_id: str,
        parent: str | None = None,
        limits: dict[str, Any] | None = None,
        timeout: float | None = None,
        **kw: Any,
    ) -> Recorded:
        config = AgentConfig(
            runtime="command",
            command=["true"],
            resource_limits=limits,  # type: ignore[arg-type]
            timeout=timeout,
        )
        return self.add(
            SpawnEvent(
                event_id=new_id(),
                agent_id=agent_id,
                parent=parent,
                task=kw.pop("task", f"task of {agent_id}"),
                config=config,
                timestamp=T0,
                **kw,
            )
        )

    def status(
        self, agent_id: str, status_type: str, summary: str = "", at: float = 0.0, **details: Any
    ) -> Recorded:
        return self.add(
            StatusEvent(
                event_id=new_id(),
                agent_id=agent_id,
                status_type=status_type,  # type: ignore[arg-type]
                payload=StatusPayload(summary=summary, details=details),
                timestamp=T0 + timedelta(seconds=at),
            )
        )

    def control(self, agent_id: str, action: str, **kw: Any) -> Recorded:
        return self.add(
            ControlEvent(event_id=new_id(), agent_id=agent_id, action=action, timestamp=T0, **kw)  # type: ignore[arg-type]
        )

    def fork(self, agent_id: str, source: str) -> Recorded:
        return self.add(
            ForkEvent(
                event_id=new_id(),
                agent_id=agent_id,
                source_agent=source,
                reason="try",
                timestamp=T0,
            )
        )

    def terminate(self, agent_id: str, reason: str = "completed", **kw: Any) -> Recorded:
        return self.add(
            TerminateEvent(event_id=new_id(), agent_id=agent_id, reason=reason, timestamp=T0, **kw)  # type: ignore[arg-type]
        )

    def artifact(self, agent_id: str, artifact_id: str, size: int = 10) -> Recorded:
        return self.add(
            ArtifactEvent(
                event_id=new_id(),
                agent_id=agent_id,
                artifact_id=artifact_id,
                name="out.txt",
                size=size,
                sha256="0" * 64,
                timestamp=T0,
            )
        )

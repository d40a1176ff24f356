"""What an agent's end looks like to whoever waited for it."""

from __future__ import annotations

from dataclasses import dataclass

from grove_events import TerminateEvent


@dataclass(frozen=True)
class AgentResult:
    """An agent's outcome: why it ended, its result summary, and the error if it failed."""

    agent_id: str
    reason: str
    summary: str
    error: str | None
    truncated: bool
    artifact: str | None
    tokens: int
    runtime_s: float

    @property
    def ok(self) -> bool:
        """True when the agent completed."""
        return self.reason == "completed"

    @classmethod
    def from_event(cls, event: TerminateEvent) -> AgentResult:
        """From the agent's terminate event."""
        return cls(
            agent_id=event.agent_id,
            reason=event.reason,
            summary=event.result.summary,
            error=event.error,
            truncated=event.result.truncated,
            artifact=event.result.artifact,
            tokens=event.usage.tokens,
            runtime_s=event.usage.runtime_s,
        )

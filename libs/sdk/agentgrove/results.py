"""What an agent's end looks like to whoever waited for it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from grove_events import StatusEvent, TerminateEvent


@dataclass(frozen=True)
class AgentResult:
    """An agent's outcome: why it ended, its result summary, and the error if it failed, with
    what it had attempted and its partial results (from its `failed` status)."""

    agent_id: str
    reason: str
    summary: str
    error: str | None
    truncated: bool
    artifact: str | None
    tokens: int
    runtime_s: float
    attempted: tuple[str, ...] = ()
    partial_results: tuple[Any, ...] = ()

    @property
    def ok(self) -> bool:
        """True when the agent completed."""
        return self.reason == "completed"

    @classmethod
    def from_event(cls, event: TerminateEvent, failure: StatusEvent | None = None) -> AgentResult:
        """From the agent's terminate event and, for a failure, its `failed` status."""
        details = failure.payload.details if failure is not None else {}
        attempted = details.get("attempted")
        partial_results = details.get("partial_results")
        return cls(
            agent_id=event.agent_id,
            reason=event.reason,
            summary=event.result.summary,
            error=event.error,
            truncated=event.result.truncated,
            artifact=event.result.artifact,
            tokens=event.usage.tokens,
            runtime_s=event.usage.runtime_s,
            attempted=tuple(map(str, attempted)) if isinstance(attempted, list) else (),
            partial_results=tuple(partial_results) if isinstance(partial_results, list) else (),
        )

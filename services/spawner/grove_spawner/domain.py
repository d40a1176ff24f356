"""The spawner's state as a pure fold: which agents each spawner started that have not ended.

A spawner uses it after a restart to learn which of its agents were lost with the old process,
so that their parents get a `failed` outcome instead of silence.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Self

from grove_core.log import Recorded
from grove_core.projection import KeyedState
from grove_events import StatusEvent, TerminateEvent

SPAWNER_ID_DETAIL = "spawner_id"


@dataclass(slots=True)
class StartedAgent:
    """An agent some spawner started, not yet terminated."""

    agent_id: str
    tree_id: str | None
    spawner_id: str
    runtime: str

    def to_row(self) -> dict[str, Any]:
        """Stored form."""
        return {
            "agent_id": self.agent_id,
            "tree_id": self.tree_id,
            "spawner_id": self.spawner_id,
            "runtime": self.runtime,
        }


@dataclass
class SpawnerState(KeyedState):
    """Started, unterminated agents by id."""

    running: dict[str, StartedAgent] = field(default_factory=dict)

    def row(self, key: str) -> dict[str, Any] | None:
        agent = self.running.get(key)
        return None if agent is None else agent.to_row()

    @classmethod
    def from_rows(cls, rows: dict[str, dict[str, Any]]) -> Self:
        state = cls()
        for key, row in rows.items():
            state.running[key] = StartedAgent(**row)
        return state

    def started_by(self, spawner_id: str) -> list[StartedAgent]:
        """The agents this spawner started that have not ended."""
        return [a for a in self.running.values() if a.spawner_id == spawner_id]


def evolve(state: SpawnerState, recorded: Recorded) -> SpawnerState:
    """Fold one event into the spawner's state."""
    event = recorded.event
    if isinstance(event, StatusEvent) and event.status_type in ("started", "resumed"):
        spawner_id = event.payload.details.get(SPAWNER_ID_DETAIL)
        if isinstance(spawner_id, str):
            state.running[event.agent_id] = StartedAgent(
                agent_id=event.agent_id,
                tree_id=event.tree_id,
                spawner_id=spawner_id,
                runtime=str(event.payload.details.get("runtime", "")),
            )
            state.touch(event.agent_id)
    elif isinstance(event, TerminateEvent) and state.running.pop(event.agent_id, None) is not None:
        state.touch(event.agent_id)
    return state

"""The artifact index as a pure fold of `artifact` events."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Self

from grove_core.log import Recorded
from grove_core.projection import KeyedState
from grove_events import ArtifactEvent


@dataclass(slots=True)
class ArtifactEntry:
    """One stored artifact."""

    artifact_id: str
    tree_id: str | None
    agent_id: str
    name: str
    media_type: str
    size: int
    sha256: str


@dataclass
class ArtifactIndex(KeyedState):
    """Artifacts by id."""

    artifacts: dict[str, ArtifactEntry] = field(default_factory=dict)

    def row(self, key: str) -> dict[str, Any] | None:
        entry = self.artifacts.get(key)
        return None if entry is None else asdict(entry)

    @classmethod
    def from_rows(cls, rows: dict[str, dict[str, Any]]) -> Self:
        return cls(artifacts={key: ArtifactEntry(**row) for key, row in rows.items()})

    @property
    def total_bytes(self) -> int:
        """Bytes over all artifacts."""
        return sum(a.size for a in self.artifacts.values())


def evolve(state: ArtifactIndex, recorded: Recorded) -> ArtifactIndex:
    """Fold one event into the index."""
    event = recorded.event
    if isinstance(event, ArtifactEvent) and event.artifact_id not in state.artifacts:
        state.artifacts[event.artifact_id] = ArtifactEntry(
            artifact_id=event.artifact_id,
            tree_id=event.tree_id,
            agent_id=event.agent_id,
            name=event.name,
            media_type=event.media_type,
            size=event.size,
            sha256=event.sha256,
        )
        state.touch(event.artifact_id)
    return state

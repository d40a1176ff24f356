"""The artifact index as a pure fold of the log.

It folds `artifact` events (action `put` adds an entry, `delete` marks it deleted) and, so that
requests can be scoped to a tree, the tree of every agent from `spawn` and `fork` events: a
child is in its parent's tree, a fork in its source's, a root is its own tree. From the live
entries it keeps, per tree, the bytes and the count of artifacts, and per blob (sha256) how
many live artifacts refer to it: a blob may go once that count is zero.

A tree is charged the full size of each of its live artifacts, even when another artifact
shares the blob: what a tree may store does not depend on what other trees stored.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Self

from grove_core.records import Recorded
from grove_core.rows import KeyedState
from grove_events import ArtifactEvent, ForkEvent, SpawnEvent

#: Row keys of the agent -> tree map start with this (artifact ids cannot hold a colon).
AGENT_KEY = "agent:"


@dataclass(slots=True)
class ArtifactEntry:
    """One artifact: who stored it, in which tree, and the blob that holds its bytes."""

    artifact_id: str
    tree_id: str | None
    agent_id: str
    name: str
    media_type: str
    size: int
    sha256: str
    #: Stream sequence of the put.
    seq: int = 0
    deleted: bool = False
    #: The agent that deleted it.
    deleted_by: str | None = None


@dataclass
class ArtifactIndex(KeyedState):
    """Artifacts by id, each agent's tree, and the totals derived from the live artifacts."""

    artifacts: dict[str, ArtifactEntry] = field(default_factory=dict)
    #: agent id -> tree id
    agents: dict[str, str] = field(default_factory=dict)
    #: tree id -> bytes of its live artifacts
    tree_bytes: Counter[str] = field(default_factory=Counter)
    #: tree id -> number of its live artifacts
    tree_counts: Counter[str] = field(default_factory=Counter)
    #: sha256 -> live artifacts whose bytes are that blob
    blob_refs: Counter[str] = field(default_factory=Counter)
    #: sha256 -> size of the blob
    blob_sizes: dict[str, int] = field(default_factory=dict)

    def row(self, key: str) -> Any:
        if key.startswith(AGENT_KEY):
            tree_id = self.agents.get(key.removeprefix(AGENT_KEY))
            return None if tree_id is None else {"tree_id": tree_id}
        return self.artifacts.get(key)

    @classmethod
    def from_rows(cls, rows: dict[str, dict[str, Any]]) -> Self:
        state = cls()
        entries = []
        for key, row in rows.items():
            if key.startswith(AGENT_KEY):
                state.agents[key.removeprefix(AGENT_KEY)] = row["tree_id"]
            else:
                entries.append(ArtifactEntry(**row))
        for entry in sorted(entries, key=lambda e: e.seq):
            state.artifacts[entry.artifact_id] = entry
            if not entry.deleted:
                state._count(entry, 1)
        return state

    def _count(self, entry: ArtifactEntry, sign: int) -> None:
        tree = entry.tree_id or entry.agent_id
        self.tree_bytes[tree] += sign * entry.size
        self.tree_counts[tree] += sign
        self.blob_refs[entry.sha256] += sign
        if self.blob_refs[entry.sha256] > 0:
            self.blob_sizes[entry.sha256] = entry.size
        else:
            del self.blob_refs[entry.sha256]
            self.blob_sizes.pop(entry.sha256, None)
        for totals in (self.tree_bytes, self.tree_counts):
            if totals[tree] == 0:
                del totals[tree]

    def tree_of(self, agent_id: str) -> str | None:
        """The tree an agent is in, as the log says; None for an agent the log does not name."""
        return self.agents.get(agent_id)

    def live(self, tree_id: str | None = None) -> list[ArtifactEntry]:
        """Live artifacts, oldest first; only one tree's when `tree_id` is given."""
        return [
            entry
            for entry in self.artifacts.values()
            if not entry.deleted and (tree_id is None or entry.tree_id == tree_id)
        ]

    @property
    def total_bytes(self) -> int:
        """Bytes over all live artifacts (a shared blob counted once per artifact)."""
        return sum(self.tree_bytes.values())

    @property
    def total_count(self) -> int:
        """Number of live artifacts."""
        return sum(self.tree_counts.values())

    @property
    def blob_bytes(self) -> int:
        """Bytes of the distinct blobs live artifacts refer to (what the bucket holds)."""
        return sum(self.blob_sizes.values())


#: The event kinds `evolve` reads.
FOLDED_KINDS = frozenset({"spawn", "fork", "artifact"})
#: The version of what `evolve` keeps: bumped by a change to the fold that changes its state,
#: so that a projection stored by the previous one is rebuilt from the log at start.
FOLD_VERSION = "1"


def evolve(state: ArtifactIndex, recorded: Recorded) -> ArtifactIndex:
    """Fold one event into the index."""
    event = recorded.event
    if isinstance(event, SpawnEvent):
        if event.agent_id not in state.agents:
            parent_tree = state.agents.get(event.parent) if event.parent else None
            tree = parent_tree or event.tree_id or event.parent or event.agent_id
            state.agents[event.agent_id] = tree
            state.touch(AGENT_KEY + event.agent_id)
    elif isinstance(event, ForkEvent):
        source_tree = state.agents.get(event.source_agent)
        if event.agent_id not in state.agents and source_tree is not None:
            state.agents[event.agent_id] = source_tree
            state.touch(AGENT_KEY + event.agent_id)
    elif isinstance(event, ArtifactEvent):
        _on_artifact(state, event, recorded.seq)
    return state


def _on_artifact(state: ArtifactIndex, event: ArtifactEvent, seq: int) -> None:
    entry = state.artifacts.get(event.artifact_id)
    if event.action == "put":
        if entry is not None:
            return
        entry = ArtifactEntry(
            artifact_id=event.artifact_id,
            tree_id=event.tree_id or state.agents.get(event.agent_id) or event.agent_id,
            agent_id=event.agent_id,
            name=event.name,
            media_type=event.media_type,
            size=event.size,
            sha256=event.sha256,
            seq=seq,
        )
        state.artifacts[entry.artifact_id] = entry
        state._count(entry, 1)
    else:
        if entry is None or entry.deleted:
            return
        entry.deleted = True
        entry.deleted_by = event.agent_id
        state._count(entry, -1)
    state.touch(event.artifact_id)

"""The agent tree as a pure fold of the log: who spawned whom, and where each agent stands.

The router keeps it as its projection; `grove tree` folds it from a replay of the log.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Self

from grove_core.records import Recorded
from grove_core.rows import KeyedState
from grove_events import ForkEvent, SpawnEvent, StatusEvent, TerminateEvent

#: Status types that say where an agent's lifecycle is (others are progress reports).
LIFECYCLE_STATES = {
    "queued": "queued",
    "admitted": "admitted",
    "started": "running",
    "resumed": "running",
    "paused": "paused",
    "rejected": "rejected",
}

ENDED = frozenset({"completed", "failed", "stopped", "timeout", "cancelled", "rejected"})


@dataclass(slots=True)
class AgentNode:
    """One agent as the tree shows it."""

    agent_id: str
    tree_id: str
    parent: str | None
    task: str
    runtime: str
    state: str = "spawning"
    last_status: str = ""
    summary: str = ""
    error: str | None = None
    children: list[str] = field(default_factory=list)
    spawn_seq: int = 0
    end_seq: int = 0
    tokens: int = 0
    #: For a fork: the agent it was forked from.
    fork_of: str | None = None

    @property
    def ended(self) -> bool:
        """Whether the agent has terminated."""
        return self.state in ENDED


@dataclass
class TreeState(KeyedState):
    """Every agent the log has named, by id."""

    agents: dict[str, AgentNode] = field(default_factory=dict)

    def row(self, key: str) -> AgentNode | None:
        return self.agents.get(key)

    @classmethod
    def from_rows(cls, rows: dict[str, dict[str, Any]]) -> Self:
        state = cls()
        for key, row in sorted(rows.items(), key=lambda kv: kv[1].get("spawn_seq", 0)):
            state.agents[key] = AgentNode(**row)
        return state

    def roots(self) -> list[AgentNode]:
        """Agents without a parent (or whose parent the log does not know), in spawn order."""
        return [n for n in self.agents.values() if n.parent is None or n.parent not in self.agents]

    def subtree(self, agent_id: str) -> list[AgentNode]:
        """The agent and all its descendants, depth first."""
        out: list[AgentNode] = []
        stack = [agent_id]
        while stack:
            node = self.agents.get(stack.pop())
            if node is None:
                continue
            out.append(node)
            stack.extend(reversed(node.children))
        return out

    def path(self, agent_id: str) -> list[str]:
        """Ids from the root down to this agent."""
        out: list[str] = []
        current: str | None = agent_id
        while current is not None and current in self.agents and current not in out:
            out.append(current)
            current = self.agents[current].parent
        return list(reversed(out))


def evolve(state: TreeState, recorded: Recorded) -> TreeState:
    """Fold one event into the tree."""
    event = recorded.event
    # Each kind is told by its class itself: the decoder makes exactly these classes, and an
    # isinstance check that fails (on a pydantic model's class) costs several times as much.
    if type(event) is SpawnEvent:
        if event.agent_id in state.agents:
            return state
        parent = state.agents.get(event.parent) if event.parent else None
        tree_id = parent.tree_id if parent else (event.tree_id or event.parent or event.agent_id)
        state.agents[event.agent_id] = AgentNode(
            agent_id=event.agent_id,
            tree_id=tree_id,
            parent=event.parent,
            task=event.task,
            runtime=event.config.runtime,
            spawn_seq=recorded.seq,
        )
        if parent is not None:
            parent.children.append(event.agent_id)
            state.touch(parent.agent_id)
        state.touch(event.agent_id)
    elif type(event) is ForkEvent:
        _on_fork(state, event, recorded.seq)
    elif type(event) is StatusEvent:
        node = state.agents.get(event.agent_id)
        if node is None or node.ended:
            return state
        node.last_status = event.status_type
        if event.payload.summary:
            node.summary = event.payload.summary
        new_state = LIFECYCLE_STATES.get(event.status_type)
        if new_state is not None:
            node.state = new_state
        state.touch(node.agent_id)
    elif type(event) is TerminateEvent:
        node = state.agents.get(event.agent_id)
        if node is None:
            return state
        node.state = event.reason
        node.summary = event.result.summary
        node.error = event.error
        node.tokens = event.usage.tokens
        node.end_seq = recorded.seq
        state.touch(node.agent_id)
    return state


def _on_fork(state: TreeState, event: ForkEvent, seq: int) -> None:
    """A fork is a sibling of its source: same parent, same tree."""
    source = state.agents.get(event.source_agent)
    if event.agent_id in state.agents or source is None:
        return
    parent = state.agents.get(source.parent) if source.parent else None
    state.agents[event.agent_id] = AgentNode(
        agent_id=event.agent_id,
        tree_id=source.tree_id,
        parent=source.parent,
        task=event.task or source.task,
        runtime=event.config.runtime if event.config else source.runtime,
        spawn_seq=seq,
        fork_of=source.agent_id,
    )
    if parent is not None:
        parent.children.append(event.agent_id)
        state.touch(parent.agent_id)
    state.touch(event.agent_id)

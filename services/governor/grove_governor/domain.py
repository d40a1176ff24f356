"""The resource-governor's state as a pure fold of events, and its admission decisions.

Nothing here does I/O or reads a clock: `evolve` folds one recorded event into the state, and
`decide` says what the governor should append next given the state and the limits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Self

from grove_core.log import Recorded
from grove_core.projection import KeyedState
from grove_events import ResourceLimits, SpawnEvent, StatusEvent, TerminateEvent

AgentPhase = Literal["pending", "queued", "admitted", "running", "rejected"]

#: Phases that hold a slot of global capacity.
HOLDS_CAPACITY: frozenset[str] = frozenset({"admitted", "running"})
#: Phases in which the governor still has something to append.
NEEDS_DECISION: frozenset[str] = frozenset({"pending", "rejected"})

AT_CAPACITY = "system at capacity, retry later"


@dataclass(slots=True)
class AgentSlot:
    """What the governor knows of one agent that has not terminated."""

    agent_id: str
    tree_id: str
    parent: str | None
    phase: AgentPhase
    #: event_id of the spawn, the cause of the decisions about this agent.
    cause: str
    #: Sequence of the newest status on `grove.status.<agent_id>` (0: none), the guard of the
    #: next decision about this agent.
    status_seq: int = 0
    reason: str = ""

    def to_row(self) -> dict[str, Any]:
        """Stored form."""
        return {
            "agent_id": self.agent_id,
            "tree_id": self.tree_id,
            "parent": self.parent,
            "phase": self.phase,
            "cause": self.cause,
            "status_seq": self.status_seq,
            "reason": self.reason,
        }


@dataclass
class GovernorState(KeyedState):
    """Agents not yet terminated, in arrival order; and how many hold capacity."""

    agents: dict[str, AgentSlot] = field(default_factory=dict)
    holding: int = 0
    #: Agents waiting for a decision (pending) or for its completion (rejected), in order.
    undecided: dict[str, None] = field(default_factory=dict, repr=False, compare=False)

    def row(self, key: str) -> dict[str, Any] | None:
        slot = self.agents.get(key)
        return None if slot is None else slot.to_row()

    @classmethod
    def from_rows(cls, rows: dict[str, dict[str, Any]]) -> Self:
        state = cls()
        ordered = sorted(rows.values(), key=lambda r: r.get("order", 0))
        for row in ordered:
            slot = AgentSlot(
                agent_id=row["agent_id"],
                tree_id=row["tree_id"],
                parent=row["parent"],
                phase=row["phase"],
                cause=row["cause"],
                status_seq=row["status_seq"],
                reason=row.get("reason", ""),
            )
            state.agents[slot.agent_id] = slot
            if slot.phase in HOLDS_CAPACITY:
                state.holding += 1
            if slot.phase in NEEDS_DECISION:
                state.undecided[slot.agent_id] = None
        return state

    def take_dirty(self) -> dict[str, dict[str, Any] | None]:
        out: dict[str, dict[str, Any] | None] = {}
        order = {key: i for i, key in enumerate(self.agents)}
        for key in self.dirty:
            row = self.row(key)
            if row is not None:
                row["order"] = order[key]
            out[key] = row
        self.dirty.clear()
        return out

    def _set_phase(self, slot: AgentSlot, phase: AgentPhase) -> None:
        was = slot.phase in HOLDS_CAPACITY
        now = phase in HOLDS_CAPACITY
        self.holding += int(now) - int(was)
        slot.phase = phase
        if phase in NEEDS_DECISION:
            self.undecided[slot.agent_id] = None
        else:
            self.undecided.pop(slot.agent_id, None)


_STATUS_PHASES: dict[str, AgentPhase] = {
    "queued": "queued",
    "admitted": "admitted",
    "started": "running",
    "resumed": "running",
    "rejected": "rejected",
}


def evolve(state: GovernorState, recorded: Recorded) -> GovernorState:
    """Fold one event into the governor's state."""
    event = recorded.event
    if isinstance(event, SpawnEvent):
        if event.agent_id in state.agents:
            return state  # a second spawn of a live agent changes nothing
        tree_id = event.tree_id
        if tree_id is None and event.parent is not None:
            parent = state.agents.get(event.parent)
            tree_id = parent.tree_id if parent is not None else event.parent
        state.agents[event.agent_id] = AgentSlot(
            agent_id=event.agent_id,
            tree_id=tree_id or event.agent_id,
            parent=event.parent,
            phase="pending",
            cause=event.event_id,
        )
        state.undecided[event.agent_id] = None
        state.touch(event.agent_id)
    elif isinstance(event, StatusEvent):
        slot = state.agents.get(event.agent_id)
        if slot is None:
            return state
        slot.status_seq = recorded.seq
        phase = _STATUS_PHASES.get(event.status_type)
        if phase is not None:
            state._set_phase(slot, phase)
            if phase == "rejected":
                slot.reason = event.payload.summary
        state.touch(event.agent_id)
    elif isinstance(event, TerminateEvent):
        slot = state.agents.pop(event.agent_id, None)
        state.undecided.pop(event.agent_id, None)
        if slot is not None:
            if slot.phase in HOLDS_CAPACITY:
                state.holding -= 1
            state.touch(event.agent_id)
    return state


@dataclass(frozen=True, slots=True)
class Admit:
    """Append `status admitted` for this agent."""

    agent_id: str
    expect_status_seq: int


@dataclass(frozen=True, slots=True)
class Reject:
    """Append `status rejected`, then `terminate reason=rejected`."""

    agent_id: str
    expect_status_seq: int
    error: str


@dataclass(frozen=True, slots=True)
class FinishRejection:
    """A rejection whose terminate is not in the log yet: append it."""

    agent_id: str
    error: str


Decision = Admit | Reject | FinishRejection


@dataclass(frozen=True, slots=True)
class InFlight:
    """A decision appended (or being appended) but not yet folded back from the log."""

    status_seq: int
    admits: bool


def decide(
    state: GovernorState, limits: ResourceLimits, in_flight: dict[str, InFlight]
) -> list[Decision]:
    """What to append next, in arrival order.

    `in_flight` holds decisions made at an agent's current status sequence; those agents are
    not decided again until the log shows their status change, and in-flight admissions count
    against capacity.
    """
    capacity = limits.global_.max_concurrent_agents
    holding = state.holding + sum(
        1 for agent_id, f in in_flight.items() if f.admits and _pending_at(state, agent_id, f)
    )
    decisions: list[Decision] = []
    for agent_id in state.undecided:
        slot = state.agents[agent_id]
        flight = in_flight.get(agent_id)
        if flight is not None and flight.status_seq == slot.status_seq:
            continue
        if slot.phase == "pending":
            if capacity is not None and holding >= capacity:
                decisions.append(Reject(agent_id, slot.status_seq, AT_CAPACITY))
            else:
                decisions.append(Admit(agent_id, slot.status_seq))
                holding += 1
        else:
            decisions.append(FinishRejection(agent_id, slot.reason or AT_CAPACITY))
    return decisions


def _pending_at(state: GovernorState, agent_id: str, flight: InFlight) -> bool:
    slot = state.agents.get(agent_id)
    return slot is not None and slot.phase == "pending" and slot.status_seq == flight.status_seq

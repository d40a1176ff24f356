"""The resource-governor's state as a pure fold of events, and its decisions.

Nothing here does I/O or reads a clock. `evolve` folds one recorded event into the state;
`decide(state, limits, now, in_flight)` says what the governor should append next. Time comes
in only as `now` and as the stream timestamps of the events, so a replay of the same log gives
the same state and the same decisions.

The limits that apply to an agent are the config file's, tightened (never loosened) by its own
spawn's `config.resource_limits` (per_agent), its parent's (per_parent, for the parent's
children) and the root's (per_tree, for the whole tree, forks and nesting included).

Capabilities are enforced here too, not only in the agent's own process: a spawn whose parent
does not hold `spawn` (its effective permissions, or a grant of its own from an approved
`permission` request earlier in the log) is rejected, by the rules of `grove_core.permissions`
that the router folds alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, Self

from grove_core.permissions import (
    AskedRequest,
    effective_permissions,
    refused_answer,
    spawn_refusal,
)
from grove_core.records import Recorded
from grove_core.rows import KeyedState
from grove_events import (
    ControlEvent,
    ForkEvent,
    HitlEvent,
    PerAgentLimits,
    PerParentLimits,
    PerTreeLimits,
    ResourceLimits,
    SpawnEvent,
    StatusEvent,
    TerminateEvent,
)

AgentPhase = Literal["pending", "queued", "admitted", "running", "rejected", "cancelling", "ended"]
StartKind = Literal["spawn", "fork", "resume"]

#: Phases that hold a slot of capacity (global, and the parent's children).
HOLDS_CAPACITY: frozenset[str] = frozenset({"admitted", "running"})
#: Phases in which the governor may still have something to append before the agent runs.
NEEDS_DECISION: frozenset[str] = frozenset({"pending", "queued", "rejected", "cancelling"})

AT_CAPACITY = "system at capacity, retry later"
MAX_CHILDREN = "max children reached"
DEFAULT_GRACE_S = 10.0


def _tighter(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    if b is None:
        return a
    return min(a, b)


def tighten_agent(base: PerAgentLimits, own: PerAgentLimits | None) -> PerAgentLimits:
    """Per-agent limits: the tighter of each field."""
    if own is None:
        return base
    return PerAgentLimits(
        max_runtime=_tighter(base.max_runtime, own.max_runtime),
        max_tokens=_tighter_int(base.max_tokens, own.max_tokens),
    )


def tighten_parent(base: PerParentLimits, own: PerParentLimits | None) -> PerParentLimits:
    """Per-parent limits: the tighter of each field."""
    if own is None:
        return base
    return PerParentLimits(
        max_children=_tighter_int(base.max_children, own.max_children),
        max_spawn_rate=_tighter(base.max_spawn_rate, own.max_spawn_rate),
    )


def tighten_tree(base: PerTreeLimits, own: PerTreeLimits | None) -> PerTreeLimits:
    """Per-tree limits: the tighter of each field."""
    if own is None:
        return base
    return PerTreeLimits(
        max_depth=_tighter_int(base.max_depth, own.max_depth),
        max_agents=_tighter_int(base.max_agents, own.max_agents),
        max_tokens=_tighter_int(base.max_tokens, own.max_tokens),
    )


def tighten_own(base: ResourceLimits | None, own: ResourceLimits | None) -> ResourceLimits | None:
    """An agent's own limits over those it inherits (a fork's over its source's): the tighter
    of each per-parent, per-agent and per-tree field (a spawn's global limits are not read)."""
    if base is None or own is None:
        return own if base is None else base
    return ResourceLimits(
        per_parent=tighten_parent(base.per_parent, own.per_parent),
        per_agent=tighten_agent(base.per_agent, own.per_agent),
        per_tree=tighten_tree(base.per_tree, own.per_tree),
    )


def _tighter_int(a: int | None, b: int | None) -> int | None:
    value = _tighter(a, b)
    return None if value is None else int(value)


@dataclass(slots=True)
class Bucket:
    """A token bucket for a spawn rate, refilled by event time: `rate` per second."""

    tokens: float = -1.0  # -1: full (never used)
    at: float = 0.0

    def available(self, rate: float, now: float) -> float:
        """Tokens at `now`."""
        burst = max(1.0, rate)
        if self.tokens < 0:
            return burst
        return min(burst, self.tokens + max(0.0, now - self.at) * rate)

    def take(self, rate: float, now: float) -> None:
        """Use one token at `now`."""
        self.tokens = self.available(rate, now) - 1.0
        self.at = now


@dataclass(slots=True)
class AgentSlot:
    """What the governor knows of one agent."""

    agent_id: str
    tree_id: str
    parent: str | None
    depth: int
    phase: AgentPhase
    #: event_id of the spawn/fork/control that made the agent wait for a decision.
    cause: str
    start_kind: StartKind = "spawn"
    #: Sequence of the newest status on `grove.status.<agent_id>` (0: none): the guard of the
    #: next status the governor appends about this agent.
    status_seq: int = 0
    #: Sequence of the newest terminate of this agent (0: none): the guard of its next one.
    terminate_seq: int = 0
    reason: str = ""
    resume_message: str | None = None
    own_limits: ResourceLimits | None = None
    timeout_s: float | None = None
    started_at: float | None = None
    notice_at: float | None = None
    tokens: int = 0
    children_holding: int = 0
    stop_reason: str | None = None
    child_bucket: Bucket = field(default_factory=Bucket)
    #: The spawn is refused whatever the limits (see `reason`): it names a parent the log does
    #: not know, or one in another tree, or one that does not hold the `spawn` capability.
    forged: bool = False
    #: Effective capabilities (None: all), as `grove_core.permissions.effective_permissions`.
    permissions: list[str] | None = None
    #: Capabilities granted to this agent alone by approved permission requests.
    granted: list[str] = field(default_factory=list)

    def to_row(self, order: int) -> dict[str, Any]:
        """Stored form."""
        return {
            "order": order,
            "agent_id": self.agent_id,
            "tree_id": self.tree_id,
            "parent": self.parent,
            "depth": self.depth,
            "phase": self.phase,
            "cause": self.cause,
            "start_kind": self.start_kind,
            "status_seq": self.status_seq,
            "terminate_seq": self.terminate_seq,
            "reason": self.reason,
            "resume_message": self.resume_message,
            "own_limits": None
            if self.own_limits is None
            else self.own_limits.model_dump(mode="json", by_alias=True, exclude_none=True),
            "timeout_s": self.timeout_s,
            "started_at": self.started_at,
            "notice_at": self.notice_at,
            "tokens": self.tokens,
            "children_holding": self.children_holding,
            "stop_reason": self.stop_reason,
            "child_bucket": [self.child_bucket.tokens, self.child_bucket.at],
            "forged": self.forged,
            "permissions": self.permissions,
            "granted": self.granted,
        }

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> AgentSlot:
        """From the stored form."""
        data = {k: v for k, v in row.items() if k not in ("order", "own_limits", "child_bucket")}
        own = row.get("own_limits")
        tokens, at = row.get("child_bucket") or (-1.0, 0.0)
        return cls(
            **data,
            own_limits=None if own is None else ResourceLimits.model_validate(own),
            child_bucket=Bucket(tokens, at),
        )


@dataclass(slots=True)
class TreeBudget:
    """What a whole tree has used, and the limits its root set for it."""

    tree_id: str
    agents: int = 0
    tokens_done: int = 0
    own_limits: PerTreeLimits | None = None

    def to_row(self) -> dict[str, Any]:
        """Stored form."""
        return {
            "tree_id": self.tree_id,
            "agents": self.agents,
            "tokens_done": self.tokens_done,
            "own_limits": None
            if self.own_limits is None
            else self.own_limits.model_dump(mode="json", exclude_none=True),
        }

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> TreeBudget:
        """From the stored form."""
        own = row.get("own_limits")
        return cls(
            tree_id=row["tree_id"],
            agents=row["agents"],
            tokens_done=row["tokens_done"],
            own_limits=None if own is None else PerTreeLimits.model_validate(own),
        )


GLOBAL_KEY = "~global"
TREE_PREFIX = "~tree:"
REQUEST_PREFIX = "~hitl:"


@dataclass
class GovernorState(KeyedState):
    """Every agent, the trees' budgets, the global counters, in arrival order."""

    agents: dict[str, AgentSlot] = field(default_factory=dict)
    trees: dict[str, TreeBudget] = field(default_factory=dict)
    holding: int = 0
    paused: bool = False
    bucket: Bucket = field(default_factory=Bucket)
    #: HITL requests by id, for the capabilities an approved permission request grants.
    requests: dict[str, AskedRequest] = field(default_factory=dict)
    #: Agents waiting for something the governor appends, in arrival order.
    undecided: dict[str, None] = field(default_factory=dict, repr=False, compare=False)
    #: Agents that run, for the runtime and token checks.
    running: dict[str, None] = field(default_factory=dict, repr=False, compare=False)
    order: dict[str, int] = field(default_factory=dict, repr=False, compare=False)
    #: How many agents are in each phase (for the gauges, without a walk over every agent).
    phases: dict[str, int] = field(default_factory=dict, repr=False, compare=False)

    def row(self, key: str) -> Any:
        if key == GLOBAL_KEY:
            return {"paused": self.paused, "bucket": [self.bucket.tokens, self.bucket.at]}
        if key.startswith(TREE_PREFIX):
            tree = self.trees.get(key[len(TREE_PREFIX) :])
            return None if tree is None else tree.to_row()
        if key.startswith(REQUEST_PREFIX):
            return self.requests.get(key[len(REQUEST_PREFIX) :])
        slot = self.agents.get(key)
        return None if slot is None else slot.to_row(self.order[key])

    @classmethod
    def from_rows(cls, rows: dict[str, dict[str, Any]]) -> Self:
        state = cls()
        glob = rows.get(GLOBAL_KEY)
        if glob is not None:
            state.paused = glob["paused"]
            state.bucket = Bucket(*glob["bucket"])
        agent_rows = [r for k, r in rows.items() if not k.startswith("~")]
        for row in sorted(agent_rows, key=lambda r: r["order"]):
            slot = AgentSlot.from_row(row)
            state.agents[slot.agent_id] = slot
            state.order[slot.agent_id] = row["order"]
            state.phases[slot.phase] = state.phases.get(slot.phase, 0) + 1
            state._index(slot)
            if slot.phase in HOLDS_CAPACITY:
                state.holding += 1
        for key, row in rows.items():
            if key.startswith(TREE_PREFIX):
                state.trees[row["tree_id"]] = TreeBudget.from_row(row)
            elif key.startswith(REQUEST_PREFIX):
                state.requests[row["request_id"]] = AskedRequest(**row)
        return state

    def _index(self, slot: AgentSlot) -> None:
        stop_pending = slot.stop_reason is not None and slot.phase == "admitted"
        if slot.phase in NEEDS_DECISION or stop_pending:
            self.undecided[slot.agent_id] = None
        else:
            self.undecided.pop(slot.agent_id, None)
        if slot.phase == "running":
            self.running[slot.agent_id] = None
        else:
            self.running.pop(slot.agent_id, None)

    def set_phase(self, slot: AgentSlot, phase: AgentPhase) -> None:
        """Move an agent to a phase, keeping the counters and indexes right."""
        was = slot.phase in HOLDS_CAPACITY
        now = phase in HOLDS_CAPACITY
        delta = int(now) - int(was)
        self.holding += delta
        if delta and slot.parent is not None:
            parent = self.agents.get(slot.parent)
            if parent is not None:
                parent.children_holding += delta
                self.touch(parent.agent_id)
        self.phases[slot.phase] -= 1
        self.phases[phase] = self.phases.get(phase, 0) + 1
        slot.phase = phase
        self._index(slot)
        self.touch(slot.agent_id)

    def add(self, slot: AgentSlot) -> None:
        """Track a new agent."""
        self.agents[slot.agent_id] = slot
        self.order[slot.agent_id] = len(self.order)
        self.phases[slot.phase] = self.phases.get(slot.phase, 0) + 1
        self._index(slot)
        self.touch(slot.agent_id)

    def tree(self, tree_id: str) -> TreeBudget:
        """The budget of a tree (created empty on first use)."""
        tree = self.trees.get(tree_id)
        if tree is None:
            tree = self.trees[tree_id] = TreeBudget(tree_id)
        return tree

    def tree_tokens(self, tree_id: str) -> int:
        """Tokens used by a tree: ended instances plus what running ones reported so far."""
        tree = self.trees.get(tree_id)
        done = tree.tokens_done if tree else 0
        return done + sum(
            self.agents[a].tokens for a in self.running if self.agents[a].tree_id == tree_id
        )


def _epoch(recorded: Recorded) -> float:
    stamp = recorded.event.timestamp
    return stamp.timestamp() if stamp is not None else 0.0


#: The event kinds `evolve` reads (messages and artifacts change nothing it decides on).
FOLDED_KINDS = frozenset({"spawn", "fork", "status", "terminate", "control", "hitl"})
#: The version of what `evolve` keeps: bumped by a change to the fold that changes its state,
#: so that a projection stored by the previous one is rebuilt from the log at start.
FOLD_VERSION = "1"


def evolve(state: GovernorState, recorded: Recorded) -> GovernorState:
    """Fold one event into the governor's state."""
    event = recorded.event
    # Each kind told by its class itself, as in `grove_core.tree.evolve`.
    if type(event) is SpawnEvent:
        _on_spawn(state, event)
    elif type(event) is ForkEvent:
        _on_fork(state, event)
    elif type(event) is StatusEvent:
        _on_status(state, event, recorded)
    elif type(event) is TerminateEvent:
        _on_terminate(state, event, recorded)
    elif type(event) is ControlEvent:
        _on_control(state, event)
    elif type(event) is HitlEvent:
        _on_hitl(state, event)
    return state


def _on_spawn(state: GovernorState, event: SpawnEvent) -> None:
    if event.agent_id in state.agents:
        return  # a second spawn of a known agent changes nothing
    parent = state.agents.get(event.parent) if event.parent else None
    tree_id = event.tree_id or (parent.tree_id if parent else event.parent or event.agent_id)
    refused = forged_parent(event, parent.tree_id if parent else None)
    if parent is not None:
        tree_id = parent.tree_id  # a child is in its parent's tree, whatever the event claims
        refused = refused or spawn_refusal(parent.agent_id, parent.permissions, parent.granted)
    permissions = effective_permissions(
        parent.permissions if parent else None, event.config.permissions
    )
    own = event.config.resource_limits
    if parent is None and tree_id not in state.trees:
        state.tree(tree_id).own_limits = own.per_tree if own is not None else None
        state.touch(TREE_PREFIX + tree_id)
    state.add(
        AgentSlot(
            agent_id=event.agent_id,
            tree_id=tree_id,
            parent=event.parent,
            depth=parent.depth + 1 if parent else (1 if event.parent else 0),
            phase="pending",
            cause=event.event_id,
            own_limits=own,
            timeout_s=event.config.timeout,
            reason=refused or "",
            forged=refused is not None,
            permissions=permissions,
        )
    )


def forged_parent(event: SpawnEvent, parent_tree: str | None) -> str | None:
    """Why a spawn's parent cannot be believed (None when it can).

    A child's parent must be an agent the log already names, and a spawn that names its tree
    must name the parent's: otherwise it would escape its tree's budgets and limits.
    """
    if event.parent is None:
        return None
    if parent_tree is None:
        return f"refused: parent {event.parent} is not an agent the log knows"
    if event.tree_id is not None and event.tree_id != parent_tree:
        return (
            f"refused: parent {event.parent} belongs to tree {parent_tree}, "
            f"not to tree {event.tree_id}"
        )
    return None


def _on_fork(state: GovernorState, event: ForkEvent) -> None:
    source = state.agents.get(event.source_agent)
    if event.agent_id in state.agents:
        return
    # A fork runs under its source's own limits, tightened by any it names itself.
    own = tighten_own(
        source.own_limits if source else None,
        event.config.resource_limits if event.config else None,
    )
    state.add(
        AgentSlot(
            agent_id=event.agent_id,
            tree_id=source.tree_id if source else (event.tree_id or event.source_agent),
            parent=source.parent if source else None,
            depth=source.depth if source else 0,
            phase="pending",
            cause=event.event_id,
            start_kind="fork",
            own_limits=own,
            timeout_s=(event.config.timeout if event.config else None)
            or (source.timeout_s if source else None),
            reason=""
            if source
            else f"refused: fork source {event.source_agent} is not an agent the log knows",
            forged=source is None,
            permissions=effective_permissions(
                source.permissions if source else None,
                event.config.permissions if event.config else None,
            ),
        )
    )


def _tree_of(state: GovernorState, agent_id: str | None) -> str | None:
    """The tree of an agent of the tree the log builds (None: not an agent, e.g. a person, or
    a fork of an unknown source, which joins no tree)."""
    slot = state.agents.get(agent_id) if agent_id else None
    if slot is None or (slot.forged and slot.start_kind == "fork"):
        return None
    return slot.tree_id


def _on_hitl(state: GovernorState, event: HitlEvent) -> None:
    """Keep HITL requests; an approved permission request grants its capability to the asker
    alone (the first answer stands; an answer about another agent, or by an agent of another
    tree, is not taken)."""
    if event.action == "request":
        if event.request_id in state.requests:
            return
        path = event.agent_path or [event.agent_id]
        state.requests[event.request_id] = AskedRequest(
            request_id=event.request_id,
            agent_id=event.agent_id,
            tree_id=event.tree_id or _tree_of(state, event.agent_id) or path[0],
            kind=event.kind,
            capability=event.capability,
        )
        state.touch(REQUEST_PREFIX + event.request_id)
        return
    request = state.requests.get(event.request_id)
    if request is None or request.answered:
        return
    if refused_answer(request, event.agent_id, event.by, _tree_of(state, event.by)):
        return
    granted = request.grants(event.answer)
    request.answered = True
    state.touch(REQUEST_PREFIX + request.request_id)
    slot = state.agents.get(request.agent_id)
    if granted is not None and slot is not None and granted not in slot.granted:
        slot.granted.append(granted)
        state.touch(slot.agent_id)


_STATUS_PHASES: dict[str, AgentPhase] = {
    "queued": "queued",
    "admitted": "admitted",
    "started": "running",
    "rejected": "rejected",
    "stopped": "cancelling",
}


def _on_status(state: GovernorState, event: StatusEvent, recorded: Recorded) -> None:
    slot = state.agents.get(event.agent_id)
    if slot is None:
        return
    slot.status_seq = recorded.seq
    kind = event.status_type
    if kind == "resumed" and event.payload.details.get("from") == "pause":
        pass
    elif kind == "stopped" and slot.phase in ("running", "ended"):
        pass  # a running agent's own report; its terminate follows
    elif kind in _STATUS_PHASES and slot.phase != "ended":
        phase = _STATUS_PHASES[kind]
        if phase == "admitted":
            now = _epoch(recorded)
            if slot.start_kind != "resume":
                state.tree(slot.tree_id).agents += 1
                state.touch(TREE_PREFIX + slot.tree_id)
            state.bucket.take(_bucket_rate(event, "global"), now)
            state.touch(GLOBAL_KEY)
            parent = state.agents.get(slot.parent) if slot.parent else None
            if parent is not None:
                parent.child_bucket.take(_bucket_rate(event, "parent"), now)
                state.touch(parent.agent_id)
        elif phase == "running":
            slot.started_at = _epoch(recorded)
            slot.notice_at = None
        elif phase in ("rejected", "cancelling"):
            slot.reason = event.payload.summary
        state.set_phase(slot, phase)
    elif kind == "timeout_notice":
        slot.notice_at = _epoch(recorded)
    tokens = event.payload.details.get("tokens")
    if isinstance(tokens, int) and tokens > slot.tokens:
        slot.tokens = tokens
    state.touch(slot.agent_id)


def _bucket_rate(event: StatusEvent, which: str) -> float:
    # The rate in force when the admission was made is recorded on the admission itself, so
    # that the bucket replays the same whatever the config says later.
    value = event.payload.details.get(f"{which}_rate")
    if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        return 0.0
    return float(value)


def _on_terminate(state: GovernorState, event: TerminateEvent, recorded: Recorded) -> None:
    slot = state.agents.get(event.agent_id)
    if slot is None:
        return
    slot.terminate_seq = recorded.seq
    tokens = max(slot.tokens, event.usage.tokens)
    state.tree(slot.tree_id).tokens_done += tokens
    state.touch(TREE_PREFIX + slot.tree_id)
    slot.tokens = 0
    slot.reason = event.reason
    slot.stop_reason = None
    slot.resume_message = None
    slot.started_at = slot.notice_at = None
    state.set_phase(slot, "ended")


def _on_control(state: GovernorState, event: ControlEvent) -> None:
    if event.action == "pause_all":
        state.paused = True
        state.touch(GLOBAL_KEY)
        return
    if event.action == "resume_all":
        state.paused = False
        state.touch(GLOBAL_KEY)
        return
    slot = state.agents.get(event.agent_id)
    if slot is None:
        return
    if event.action == "stop" and slot.phase in ("pending", "queued", "admitted"):
        slot.stop_reason = event.reason or "stopped"
        state.set_phase(slot, slot.phase)  # re-index: it now needs a decision
    elif event.action == "resume" and slot.phase == "ended" and slot.reason != "rejected":
        slot.start_kind = "resume"
        slot.cause = event.event_id
        slot.resume_message = event.message
        state.set_phase(slot, "pending")


# -- decisions ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Admit:
    """Append `status admitted`."""

    agent_id: str
    expect_status_seq: int
    start: StartKind = "spawn"
    message: str | None = None


@dataclass(frozen=True, slots=True)
class Queue:
    """Append `status queued`: admitted later, in order."""

    agent_id: str
    expect_status_seq: int
    why: str


@dataclass(frozen=True, slots=True)
class Reject:
    """Append `status rejected`, then `terminate reason=rejected`."""

    agent_id: str
    expect_status_seq: int
    error: str


@dataclass(frozen=True, slots=True)
class Cancel:
    """A stop before the agent started: `status stopped`, then `terminate reason=cancelled`."""

    agent_id: str
    expect_status_seq: int
    why: str


@dataclass(frozen=True, slots=True)
class Finish:
    """A rejection or cancellation whose terminate is not in the log yet: append it."""

    agent_id: str
    expect_terminate_seq: int
    reason: Literal["rejected", "cancelled"]
    error: str


@dataclass(frozen=True, slots=True)
class Notice:
    """Append `status timeout_notice`: the agent is over a limit and will be stopped."""

    agent_id: str
    why: str


@dataclass(frozen=True, slots=True)
class TimeOut:
    """Append `terminate reason=timeout`: the grace after the notice is over."""

    agent_id: str
    expect_terminate_seq: int
    why: str


Decision = Admit | Queue | Reject | Cancel | Finish | Notice | TimeOut


@dataclass(frozen=True, slots=True)
class InFlight:
    """A decision appended (or being appended) but not yet folded back from the log."""

    status_seq: int
    terminate_seq: int
    admits: bool


@dataclass
class _Scratch:
    """Counters for one round of decisions, with in-flight admissions already applied."""

    holding: int
    tree_agents: dict[str, int]
    children: dict[str, int]
    global_tokens: float
    parent_tokens: dict[str, float]


def effective_agent_limits(
    state: GovernorState, limits: ResourceLimits, slot: AgentSlot
) -> PerAgentLimits:
    """The per-agent limits that apply to `slot`."""
    own = slot.own_limits.per_agent if slot.own_limits else None
    base = tighten_agent(limits.per_agent, own)
    if slot.timeout_s is not None:
        base = tighten_agent(base, PerAgentLimits(max_runtime=slot.timeout_s))
    return base


def effective_parent_limits(
    state: GovernorState, limits: ResourceLimits, parent: AgentSlot | None
) -> PerParentLimits:
    """The per-parent limits that apply to the children of `parent`."""
    own = parent.own_limits.per_parent if parent and parent.own_limits else None
    return tighten_parent(limits.per_parent, own)


def effective_tree_limits(
    state: GovernorState, limits: ResourceLimits, tree_id: str
) -> PerTreeLimits:
    """The per-tree limits of a tree."""
    tree = state.trees.get(tree_id)
    return tighten_tree(limits.per_tree, tree.own_limits if tree else None)


def decide(
    state: GovernorState,
    limits: ResourceLimits,
    now: float,
    in_flight: dict[str, InFlight],
    grace_s: float = DEFAULT_GRACE_S,
    *,
    check_limits: bool = True,
) -> list[Decision]:
    """What to append next, in arrival order, at time `now` (seconds since the epoch).

    Agents with a decision in flight at their current sequences are skipped; in-flight
    admissions count against every limit as if already in the log. Without `check_limits`,
    running agents are not checked against their runtime and token limits (a walk over all of
    them); the caller checks them on its clock.
    """
    scratch = _scratch(state, limits, now, in_flight)
    decisions: list[Decision] = []
    global_blocked = False
    blocked_parents: set[str] = set()
    for agent_id in state.undecided:
        slot = state.agents[agent_id]
        if _in_flight(slot, in_flight):
            continue
        if slot.phase == "rejected":
            decisions.append(
                Finish(agent_id, slot.terminate_seq, "rejected", slot.reason or AT_CAPACITY)
            )
            continue
        if slot.phase == "cancelling":
            decisions.append(
                Finish(agent_id, slot.terminate_seq, "cancelled", slot.reason or "stopped")
            )
            continue
        if slot.stop_reason is not None:
            decisions.append(Cancel(agent_id, slot.status_seq, slot.stop_reason))
            continue
        if slot.phase == "admitted":
            continue
        decision = _admission(
            state,
            limits,
            slot,
            scratch=scratch,
            now=now,
            global_blocked=global_blocked,
            blocked_parents=blocked_parents,
        )
        if isinstance(decision, Queue):
            if decision.why.startswith("global") or state.paused:
                global_blocked = True
            elif slot.parent is not None:
                blocked_parents.add(slot.parent)
            if slot.phase == "queued":
                continue  # already queued: it waits, in order
        decisions.append(decision)
    if check_limits:
        decisions.extend(_over_limits(state, limits, now, in_flight, grace_s))
    return decisions


def _in_flight(slot: AgentSlot, in_flight: dict[str, InFlight]) -> bool:
    flight = in_flight.get(slot.agent_id)
    return (
        flight is not None
        and flight.status_seq == slot.status_seq
        and flight.terminate_seq == slot.terminate_seq
    )


def _scratch(
    state: GovernorState, limits: ResourceLimits, now: float, in_flight: dict[str, InFlight]
) -> _Scratch:
    global_rate = limits.global_.max_spawn_rate
    scratch = _Scratch(
        holding=state.holding,
        tree_agents={},
        children={},
        global_tokens=state.bucket.available(global_rate, now) if global_rate else 0.0,
        parent_tokens={},
    )
    for agent_id, flight in in_flight.items():
        slot = state.agents.get(agent_id)
        if not flight.admits or slot is None or not _in_flight(slot, in_flight):
            continue
        if slot.phase not in ("pending", "queued"):
            continue
        _count_admission(state, limits, slot, scratch, now)
    return scratch


def _count_admission(
    state: GovernorState, limits: ResourceLimits, slot: AgentSlot, scratch: _Scratch, now: float
) -> None:
    scratch.holding += 1
    if slot.start_kind != "resume":
        scratch.tree_agents[slot.tree_id] = scratch.tree_agents.get(slot.tree_id, 0) + 1
    scratch.global_tokens -= 1
    if slot.parent is not None:
        scratch.children[slot.parent] = scratch.children.get(slot.parent, 0) + 1
        tokens = _parent_tokens(state, limits, slot.parent, scratch, now)
        scratch.parent_tokens[slot.parent] = tokens - 1


def _parent_tokens(
    state: GovernorState, limits: ResourceLimits, parent_id: str, scratch: _Scratch, now: float
) -> float:
    if parent_id in scratch.parent_tokens:
        return scratch.parent_tokens[parent_id]
    parent = state.agents.get(parent_id)
    rate = effective_parent_limits(state, limits, parent).max_spawn_rate
    if parent is None or rate is None:
        return float("inf")
    return parent.child_bucket.available(rate, now)


def _admission(
    state: GovernorState,
    limits: ResourceLimits,
    slot: AgentSlot,
    *,
    scratch: _Scratch,
    now: float,
    global_blocked: bool,
    blocked_parents: set[str],
) -> Decision:
    tree_limits = effective_tree_limits(state, limits, slot.tree_id)
    seq = slot.status_seq
    if slot.forged:
        return Reject(slot.agent_id, seq, slot.reason)
    if tree_limits.max_depth is not None and slot.depth > tree_limits.max_depth:
        return Reject(
            slot.agent_id,
            seq,
            f"max depth exceeded: depth {slot.depth} > per_tree.max_depth={tree_limits.max_depth}",
        )
    if slot.start_kind != "resume" and tree_limits.max_agents is not None:
        used = state.tree(slot.tree_id).agents if slot.tree_id in state.trees else 0
        if used + scratch.tree_agents.get(slot.tree_id, 0) >= tree_limits.max_agents:
            return Reject(
                slot.agent_id,
                seq,
                f"tree agent budget reached: per_tree.max_agents={tree_limits.max_agents}",
            )
    if (
        tree_limits.max_tokens is not None
        and state.tree_tokens(slot.tree_id) >= tree_limits.max_tokens
    ):
        return Reject(
            slot.agent_id,
            seq,
            f"tree token budget exhausted: per_tree.max_tokens={tree_limits.max_tokens}",
        )
    parent = state.agents.get(slot.parent) if slot.parent else None
    parent_limits = effective_parent_limits(state, limits, parent)
    if parent is not None and parent_limits.max_children is not None:
        children = parent.children_holding + scratch.children.get(parent.agent_id, 0)
        if children >= parent_limits.max_children:
            return Reject(slot.agent_id, seq, MAX_CHILDREN)
    capacity = limits.global_.max_concurrent_agents
    if capacity is not None and scratch.holding >= capacity:
        return Reject(slot.agent_id, seq, AT_CAPACITY)
    if state.paused:
        return Queue(slot.agent_id, seq, "paused: no admissions until resume_all")
    if global_blocked:
        return Queue(slot.agent_id, seq, "global.max_spawn_rate: waiting in line")
    if limits.global_.max_spawn_rate is not None and scratch.global_tokens < 1:
        return Queue(slot.agent_id, seq, f"global.max_spawn_rate={limits.global_.max_spawn_rate}/s")
    if parent is not None and parent.agent_id in blocked_parents:
        return Queue(slot.agent_id, seq, "per_parent.max_spawn_rate: waiting in line")
    if parent is not None and _parent_tokens(state, limits, parent.agent_id, scratch, now) < 1:
        return Queue(
            slot.agent_id, seq, f"per_parent.max_spawn_rate={parent_limits.max_spawn_rate}/s"
        )
    _count_admission(state, limits, slot, scratch, now)
    return Admit(slot.agent_id, seq, slot.start_kind, slot.resume_message)


def _over_limits(
    state: GovernorState,
    limits: ResourceLimits,
    now: float,
    in_flight: dict[str, InFlight],
    grace_s: float,
) -> list[Decision]:
    out: list[Decision] = []
    for agent_id in state.running:
        slot = state.agents[agent_id]
        if _in_flight(slot, in_flight) or slot.started_at is None:
            continue
        why = _over(state, limits, slot, now)
        if why is None:
            continue
        if slot.notice_at is None:
            out.append(Notice(agent_id, why))
        elif now - slot.notice_at >= grace_s:
            out.append(TimeOut(agent_id, slot.terminate_seq, why))
    return out


def _over(state: GovernorState, limits: ResourceLimits, slot: AgentSlot, now: float) -> str | None:
    agent_limits = effective_agent_limits(state, limits, slot)
    assert slot.started_at is not None
    if agent_limits.max_runtime is not None and now - slot.started_at > agent_limits.max_runtime:
        return f"max_runtime {agent_limits.max_runtime:g}s exceeded (per_agent.max_runtime)"
    if agent_limits.max_tokens is not None and slot.tokens > agent_limits.max_tokens:
        return f"max_tokens {agent_limits.max_tokens} exceeded (per_agent.max_tokens)"
    tree_limits = effective_tree_limits(state, limits, slot.tree_id)
    if (
        tree_limits.max_tokens is not None
        and state.tree_tokens(slot.tree_id) > tree_limits.max_tokens
    ):
        return f"tree token budget {tree_limits.max_tokens} exceeded (per_tree.max_tokens)"
    return None


def resource_status(
    state: GovernorState, limits: ResourceLimits, agent_id: str | None, now: float
) -> dict[str, Any]:
    """The answer to `get_resource_status` for an agent (or for a caller: no `self`)."""
    capacity = limits.global_.max_concurrent_agents
    out: dict[str, Any] = {
        "global": {
            "agents_running": state.holding,
            "capacity": capacity,
            "utilization": round(state.holding / capacity, 4) if capacity else 0.0,
            "queued": sum(1 for a in state.undecided if state.agents[a].phase == "queued"),
            "paused": state.paused,
        }
    }
    slot = state.agents.get(agent_id) if agent_id else None
    if slot is not None:
        parent_limits = effective_parent_limits(state, limits, slot)
        out["self"] = {
            "agent_id": slot.agent_id,
            "phase": slot.phase,
            "children_running": slot.children_holding,
            "children_limit": parent_limits.max_children,
            "runtime_elapsed": round(now - slot.started_at, 3) if slot.started_at else 0.0,
            "tokens": slot.tokens,
            "tree_tokens": state.tree_tokens(slot.tree_id),
        }
    return out

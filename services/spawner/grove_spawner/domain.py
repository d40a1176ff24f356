"""The spawner's domain, with no I/O: the fold of started agents, and the pure decisions.

- `SpawnerState` / `evolve`: which agents each spawner started that have not ended, and
  which admissions no instance has started from yet. A spawner uses the first after a restart
  to learn which of its agents were lost with the old process, and to notice a peer that went
  silent while it had agents running, so that their parents get a `failed` outcome instead of
  silence; the second is the work the replicas share (`owner` says whose each one is).
- `FreshAgents`: agents whose first spawn this process has folded and that have not ended,
  with what an admission of that spawn needs to know (so it needs no reads of the log).
- `StartKind`, `start_allowed`: when an admission may start an agent instance.
- `fork_spawn`: the spawn a fork runs as, from the fork event and its source's spawn.
- `owner`, `AdmissionDesk`: which spawner starts a waiting admission, and when.
- `PeerWatch`: when each spawner was last heard from, against a clock the caller passes in.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, defaultdict
from collections.abc import Container, Iterable
from dataclasses import dataclass, field
from typing import Any, Self, get_args

from agentgrove.context import StartKind
from grove_core.records import Recorded
from grove_core.rows import KeyedState
from grove_events import ControlEvent, ForkEvent, SpawnEvent, StatusEvent, TerminateEvent

SPAWNER_ID_DETAIL = "spawner_id"

START_KINDS: tuple[str, ...] = get_args(StartKind)


@dataclass(slots=True)
class StartedAgent:
    """An agent instance some spawner started, not yet terminated."""

    agent_id: str
    tree_id: str | None
    spawner_id: str
    runtime: str
    session_id: str | None = None
    #: Stream sequence of the `started` status of this instance.
    started_seq: int = 0

    def to_row(self) -> dict[str, Any]:
        """Stored form."""
        return {
            "agent_id": self.agent_id,
            "tree_id": self.tree_id,
            "spawner_id": self.spawner_id,
            "runtime": self.runtime,
            "session_id": self.session_id,
            "started_seq": self.started_seq,
        }


#: Row keys of waiting admissions (the agents' rows are keyed by the bare agent id).
ADMITTED_PREFIX = "~admitted:"


@dataclass
class SpawnerState(KeyedState):
    """Started, unterminated agents by id; admissions waiting for a start."""

    running: dict[str, StartedAgent] = field(default_factory=dict)
    #: Admissions no instance has started from and no end has overtaken: agent id -> the
    #: stream sequence of its newest such `admitted` status.
    admitted: dict[str, int] = field(default_factory=dict)

    def row(self, key: str) -> Any:
        if key.startswith(ADMITTED_PREFIX):
            agent_id = key[len(ADMITTED_PREFIX) :]
            seq = self.admitted.get(agent_id)
            return None if seq is None else {"agent_id": agent_id, "seq": seq}
        agent = self.running.get(key)
        return None if agent is None else agent.to_row()

    @classmethod
    def from_rows(cls, rows: dict[str, dict[str, Any]]) -> Self:
        state = cls()
        for key, row in rows.items():
            if key.startswith(ADMITTED_PREFIX):
                state.admitted[row["agent_id"]] = row["seq"]
            else:
                state.running[key] = StartedAgent(**row)
        return state

    def admit(self, agent_id: str, seq: int) -> None:
        """An admission of the agent waits for a start."""
        self.admitted[agent_id] = seq
        self.touch(ADMITTED_PREFIX + agent_id)

    def settle(self, agent_id: str) -> None:
        """The agent's waiting admission, if any, waits no more (a start, an end)."""
        if self.admitted.pop(agent_id, None) is not None:
            self.touch(ADMITTED_PREFIX + agent_id)

    def started_by(self, spawner_id: str) -> list[StartedAgent]:
        """The agents this spawner started that have not ended."""
        return [a for a in self.running.values() if a.spawner_id == spawner_id]

    def by_spawner(self) -> dict[str, list[StartedAgent]]:
        """Unterminated agents grouped by the spawner that started them."""
        out: dict[str, list[StartedAgent]] = defaultdict(list)
        for agent in self.running.values():
            out[agent.spawner_id].append(agent)
        return dict(out)


#: The event kinds `evolve` reads.
FOLDED_KINDS = frozenset({"status", "terminate"})
#: The version of what `evolve` keeps: bumped by a change to the fold that changes its state,
#: so that a projection stored by the previous one is rebuilt from the log at start.
FOLD_VERSION = "2"


def evolve(state: SpawnerState, recorded: Recorded) -> SpawnerState:
    """Fold one event into the spawner's state."""
    event = recorded.event
    if type(event) is StatusEvent and event.status_type == "admitted":
        # An admission while an instance runs starts nothing (the governor admits a spawn
        # once; a copy of its admission is not a second start).
        if event.agent_id not in state.running:
            state.admit(event.agent_id, recorded.seq)
    elif type(event) is StatusEvent and event.status_type in ("started", "resumed"):
        if event.status_type == "started":
            state.settle(event.agent_id)
        spawner_id = event.payload.details.get(SPAWNER_ID_DETAIL)
        if not isinstance(spawner_id, str):
            return state
        if event.status_type == "resumed" and event.agent_id in state.running:
            return state  # back from a pause: the same instance goes on
        state.running[event.agent_id] = StartedAgent(
            agent_id=event.agent_id,
            tree_id=event.tree_id,
            spawner_id=spawner_id,
            runtime=str(event.payload.details.get("runtime", "")),
            session_id=event.session_id,
            started_seq=recorded.seq,
        )
        state.touch(event.agent_id)
    elif type(event) is TerminateEvent:
        state.settle(event.agent_id)
        if state.running.pop(event.agent_id, None) is not None:
            state.touch(event.agent_id)
    return state


def owner(agent_id: str, spawner_ids: Iterable[str]) -> str | None:
    """Which of the spawners should start the agent's admission (None: no spawner given).

    Rendezvous hashing: each spawner scores the agent, the highest score wins. Every replica
    that knows the same spawners picks the same owner without asking anyone, the admissions
    spread evenly, and when a spawner leaves only its own admissions move to others.
    """
    best: tuple[bytes, str] | None = None
    for spawner_id in spawner_ids:
        score = hashlib.blake2b(f"{spawner_id}\0{agent_id}".encode(), digest_size=8).digest()
        if best is None or (score, spawner_id) > best:
            best = (score, spawner_id)
    return None if best is None else best[1]


#: Most agents `FreshAgents` keeps (the oldest spawns go first; their admissions read the log).
MAX_FRESH = 10_000


@dataclass(slots=True)
class FreshAgent:
    """An agent whose first spawn was folded and that has not ended since."""

    spawn: SpawnEvent
    #: Whether a `started` status of the agent was folded.
    started: bool = False
    #: The stop's reason, when the agent's newest control is a stop.
    stop: str | None = None


@dataclass
class FreshAgents:
    """What the admission of a spawn needs, from the events folded since this process began.

    An agent's events all come after its first spawn, the spawn the governor admits (it
    ignores any later one, and the admission names it as its cause). So once this has folded
    that spawn, it has folded everything of the agent, and answers as reads of the log would:
    no end, whether it started, whether its newest control is a stop. For an agent whose
    first spawn it did not fold (it came before this process began, or was dropped to stay
    within `limit`), `get` says None, and the caller reads the log.
    """

    agents: OrderedDict[str, FreshAgent] = field(default_factory=OrderedDict)
    limit: int = MAX_FRESH

    def get(self, agent_id: str, spawn_event_id: str | None) -> FreshAgent | None:
        """The agent, if the spawn `spawn_event_id` (an admission's cause) is the first of
        it folded here and the agent has not ended since."""
        agent = self.agents.get(agent_id)
        if agent is None or agent.spawn.event_id != spawn_event_id:
            return None
        return agent

    def fold(self, recorded: Recorded) -> None:
        """Take in one event (of any kind, in stream order)."""
        event = recorded.event
        agent_id = event.agent_id
        if isinstance(event, SpawnEvent):
            if agent_id not in self.agents:  # a later spawn of the agent changes nothing
                self.agents[agent_id] = FreshAgent(event)
                if len(self.agents) > self.limit:
                    self.agents.popitem(last=False)
        elif isinstance(event, StatusEvent):
            if event.status_type == "started" and (agent := self.agents.get(agent_id)):
                agent.started = True
        elif isinstance(event, ControlEvent):
            if (agent := self.agents.get(agent_id)) is not None:
                agent.stop = (event.reason or "stopped") if event.action == "stop" else None
        elif isinstance(event, TerminateEvent):
            self.agents.pop(agent_id, None)


def start_allowed(kind: StartKind, admitted_seq: int, last_terminate_seq: int | None) -> bool:
    """Whether an admission at `admitted_seq` may start a new instance of its agent.

    A spawn or a fork starts an agent that has never ended; a resume starts one whose last
    instance ended before the admission. (Whether an instance already started since that end
    is checked against the log, with the `started` status guarded by the admission.)
    """
    if kind == "resume":
        return last_terminate_seq is not None and admitted_seq > last_terminate_seq
    return last_terminate_seq is None


def fork_spawn(fork: ForkEvent, source: SpawnEvent) -> SpawnEvent:
    """The spawn a fork runs as: the source's, with what the fork event overrides.

    The fork is a new agent in the source's tree, beside the source (same parent); its task,
    config and subscriptions default to the source's.
    """
    return SpawnEvent(
        event_id=fork.event_id,
        agent_id=fork.agent_id,
        session_id=fork.session_id,
        tree_id=fork.tree_id or source.tree_id,
        timestamp=fork.timestamp,
        causation_id=fork.causation_id,
        correlation_id=fork.correlation_id,
        task=fork.task or source.task,
        parent=source.parent,
        initial_context=source.initial_context,
        subscriptions=(
            list(source.subscriptions) if fork.subscriptions is None else list(fork.subscriptions)
        ),
        subscribe_parent=source.subscribe_parent,
        config=fork.config or source.config,
        fork_from=fork.source_agent,
    )


@dataclass
class AdmissionDesk:
    """What one spawner process adds to the fold's waiting admissions
    (`SpawnerState.admitted`): when it first saw each, and which it has decided on (started
    its agent, or found that it starts nothing), so as not to try those again.

    `due` says which waiting admissions to start now: those this spawner owns among the
    spawners `sharing` them, and any that has waited `overdue_after` seconds whoever owns
    it (its owner may be stuck). Times are whatever monotonic clock the caller uses.
    """

    own_id: str
    decided: dict[str, int] = field(default_factory=dict)
    seen: dict[str, tuple[int, float]] = field(default_factory=dict)

    def saw(self, agent_id: str, seq: int, now: float) -> None:
        """An admission was folded just now."""
        self.seen[agent_id] = (seq, now)

    def decide(self, agent_id: str, seq: int) -> None:
        """This process is done with the admission at `seq`."""
        self.decided[agent_id] = seq

    def due(
        self,
        waiting: dict[str, int],
        busy: Container[str],
        sharing: Iterable[str],
        now: float,
        overdue_after: float,
    ) -> list[tuple[str, int]]:
        """(agent id, sequence) of the admissions to start now; `busy` are the agents this
        process is starting or running. Forgets what no longer waits."""
        self.decided = {a: seq for a, seq in self.decided.items() if waiting.get(a) == seq}
        self.seen = {a: seen for a, seen in self.seen.items() if waiting.get(a) == seen[0]}
        sharing = list(sharing)
        out = []
        for agent_id, seq in waiting.items():
            if agent_id in busy or self.decided.get(agent_id) == seq:
                continue
            first = self.seen.setdefault(agent_id, (seq, now))[1]
            if now - first >= overdue_after or owner(agent_id, sharing) == self.own_id:
                out.append((agent_id, seq))
        return out

    def undecided(self, waiting: dict[str, int]) -> int:
        """How many waiting admissions this process has not decided on."""
        return sum(1 for a, seq in waiting.items() if self.decided.get(a) != seq)


@dataclass
class PeerWatch:
    """When each spawner was last heard from (a heartbeat or a `started` of its own).

    Times are whatever monotonic clock the caller uses. A spawner never heard from counts as
    heard at `since`, when the watch began, so a peer gets a full timeout from then.
    """

    since: float
    heard: dict[str, float] = field(default_factory=dict)

    def hear(self, spawner_id: str, now: float) -> None:
        """A sign of life from a spawner."""
        self.heard[spawner_id] = max(now, self.heard.get(spawner_id, now))

    def forget(self, spawner_id: str) -> None:
        """A spawner said it is leaving."""
        self.heard.pop(spawner_id, None)

    def alive(self, now: float, within: float) -> list[str]:
        """The spawners heard from in the last `within` seconds."""
        return [spawner_id for spawner_id, at in self.heard.items() if now - at <= within]

    def silent_for(self, spawner_id: str, now: float) -> float:
        """Seconds since the spawner was last heard from."""
        return now - self.heard.get(spawner_id, self.since)

    def lost(
        self, state: SpawnerState, now: float, timeout: float, own_id: str
    ) -> dict[str, list[StartedAgent]]:
        """Peers with unterminated agents not heard from for more than `timeout` seconds."""
        return {
            spawner_id: agents
            for spawner_id, agents in state.by_spawner().items()
            if spawner_id != own_id and self.silent_for(spawner_id, now) > timeout
        }

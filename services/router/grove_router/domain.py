"""The router's domain: subscriptions, inboxes, HITL requests and permissions as a pure fold.

Every event is routed to *addresses* (`agent:X`, `task:X`, `lineage:X`, `subtree:X`,
`topic:NAME`, `broadcast:all`); an index from address to subscribers gives the agents whose
inbox receives it, without a scan over all agents. An inbox is the ordered list of stream
sequences delivered to one agent, so replaying the log from sequence 1 rebuilds every inbox.

Delivery happens while the recipient runs (between its `started` status and its terminate).
What arrives while it does not run is held, and delivered when it next starts: higher
priority first, then in log order, and without the messages whose ttl ran out by then (the
time is the events' own timestamps, so every replay decides the same).

A child's `failed` status is a notice for its manager: besides `task:<child>` it goes to the
subscribers of `subtree:<child>`, the child's other statuses (progress) do not.

Under `global.max_message_rate`, messages beyond the rate are not dropped but paced: a token
bucket kept on the times the log stored the messages (the generic cell rate algorithm, a burst
of `max(1, rate)`) gives each message the moment it may be read, `not_before`, on every entry
it makes. The inbox served to an agent stops at the first entry not due yet, so paced messages
are read later and in log order. The same log and the same rate give the same moments on
every replay. The stream's time, not the message's own timestamp, which its sender chose: a
message dated years ahead would otherwise have held every later message back until then.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from itertools import takewhile
from typing import Any, Self

from grove_core.permissions import effective_permissions, is_approval
from grove_core.records import Recorded
from grove_core.rows import KeyedState
from grove_core.tree import TreeState
from grove_core.tree import evolve as evolve_tree
from grove_events import (
    ControlEvent,
    Event,
    ForkEvent,
    HitlEvent,
    MessageEvent,
    SpawnEvent,
    StatusEvent,
    TerminateEvent,
)

#: Rank of an injected message: above every message priority, so it is read first.
INJECTED_PRIORITY = 100
#: The topic whose messages also reach `broadcast:all`.
BROADCAST_TOPIC = "all"
#: Status detail by which an agent commits how far it has read its inbox.
INBOX_CURSOR_DETAIL = "inbox_cursor"
#: A child's statuses that are notices for its manager (to `subtree:<child>`), not progress.
NOTICE_STATUSES = frozenset({"failed"})
#: The row of the message rate's bucket.
PACE_KEY = "pace:messages"
#: A moment this close to the storage time is that time (float sums drift by less).
TIMESTAMP_RESOLUTION_S = 1e-6


def _utc(moment: datetime) -> datetime:
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


@dataclass(slots=True)
class InboxEntry:
    """One event delivered to an agent: where it is in the log and how it got there."""

    seq: int
    type: str
    source: str | None
    agent_path: list[str]
    priority: int = 0
    via: str = ""
    injected: bool = False
    expires: str | None = None
    #: Position in the recipient's inbox, from 1; 0 while held for a recipient not running.
    index: int = 0
    #: The moment the message rate lets the entry be read (None: at once).
    not_before: str | None = None

    def expired_at(self, moment: datetime | None) -> bool:
        """Whether the entry's ttl ran out before `moment`."""
        if self.expires is None or moment is None:
            return False
        return _utc(datetime.fromisoformat(self.expires)) < _utc(moment)

    def due_at(self) -> datetime | None:
        """When the message rate lets the entry be read (None: at once)."""
        return None if self.not_before is None else _utc(datetime.fromisoformat(self.not_before))

    def held_at(self, now: datetime) -> bool:
        """Whether the message rate still holds the entry back at `now`."""
        due = self.due_at()
        return due is not None and due > _utc(now)


@dataclass(slots=True)
class MessagePace:
    """The global message rate's bucket, as a theoretical arrival time on the stream's time.

    Each message is given the moment it may be delivered: at once while the burst lasts, then
    one every `1 / rate` seconds after the one before, in log order.
    """

    #: When the next message would be due if none had come early (epoch seconds; 0: never used).
    theoretical: float = 0.0

    def pace(self, sent: float, rate: float) -> float:
        """The moment a message sent at `sent` may be delivered under `rate` per second."""
        interval = 1.0 / rate
        burst = max(1.0, rate)
        release = max(sent, self.theoretical - (burst - 1.0) * interval)
        self.theoretical = max(self.theoretical, sent) + interval
        return release


@dataclass(slots=True)
class Route:
    """What the router keeps for one agent besides its tree node."""

    agent_id: str
    subscriptions: list[str] = field(default_factory=list)
    running: bool = False
    #: Entries delivered so far (the inbox's length).
    delivered: int = 0
    #: How far the agent has committed reading its inbox.
    committed: int = 0
    held: list[InboxEntry] = field(default_factory=list)
    #: Effective capabilities; None means all.
    permissions: list[str] | None = None
    #: Capabilities granted to this agent alone by approved permission requests.
    granted: list[str] = field(default_factory=list)

    def holds(self, capability: str) -> bool:
        """Whether the agent may use `capability`."""
        return (
            self.permissions is None or capability in self.permissions or capability in self.granted
        )


@dataclass(slots=True)
class HitlRequest:
    """A question for a human (or a permission request) and, once given, its answer."""

    request_id: str
    agent_id: str
    tree_id: str
    agent_path: list[str]
    kind: str
    prompt: str
    options: list[str]
    summary: str | None
    capability: str | None
    seq: int
    asked_at: str | None = None
    answer: str | None = None
    by: str | None = None
    answer_seq: int = 0

    @property
    def pending(self) -> bool:
        """Whether nobody has answered yet."""
        return self.answer_seq == 0


@dataclass
class RouterState(KeyedState):
    """The tree, every agent's route and inbox, and the HITL requests."""

    tree: TreeState = field(default_factory=TreeState)
    routes: dict[str, Route] = field(default_factory=dict)
    inboxes: dict[str, list[InboxEntry]] = field(default_factory=dict)
    requests: dict[str, HitlRequest] = field(default_factory=dict)
    #: The global message rate's bucket (used only under `global.max_message_rate`).
    pace: MessagePace = field(default_factory=MessagePace)
    #: address -> agents subscribed to it (derived from the routes, not stored).
    subscribers: dict[str, set[str]] = field(default_factory=dict, repr=False)
    #: Agents whose inbox grew with the last event folded (not stored; for waking readers).
    woken: set[str] = field(default_factory=set, repr=False, compare=False)
    #: Seconds the last event folded (a message) was put off by the message rate (not stored).
    paced_s: float = field(default=0.0, repr=False, compare=False)
    #: Why the last event folded was refused, when it was (not stored; the service records it).
    refused: str | None = field(default=None, repr=False, compare=False)

    # -- storage -------------------------------------------------------------------------

    def row(self, key: str) -> Any:
        kind, _, rest = key.partition(":")
        if kind == "route":
            return self.routes.get(rest)
        if kind == "inbox":
            agent_id, _, index = rest.rpartition(":")
            entries = self.inboxes.get(agent_id, [])
            position = int(index) - 1
            return entries[position] if 0 <= position < len(entries) else None
        if kind == "hitl":
            return self.requests.get(rest)
        if key == PACE_KEY:
            return self.pace
        return None

    def dirty_rows(self) -> dict[str, Any]:
        out = {f"node:{key}": row for key, row in self.tree.dirty_rows().items()}
        out.update(super().dirty_rows())
        return out

    @classmethod
    def from_rows(cls, rows: dict[str, dict[str, Any]]) -> Self:
        state = cls()
        nodes: dict[str, dict[str, Any]] = {}
        entries: list[tuple[str, InboxEntry]] = []
        for key, row in rows.items():
            kind, _, rest = key.partition(":")
            if kind == "node":
                nodes[rest] = row
            elif kind == "route":
                held = [InboxEntry(**entry) for entry in row.get("held", [])]
                state.routes[rest] = Route(**{**row, "held": held})
            elif kind == "inbox":
                entries.append((rest.rpartition(":")[0], InboxEntry(**row)))
            elif kind == "hitl":
                state.requests[rest] = HitlRequest(**row)
            elif key == PACE_KEY:
                state.pace = MessagePace(**row)
        state.tree = TreeState.from_rows(nodes)
        for agent_id, entry in sorted(entries, key=lambda item: item[1].index):
            state.inboxes.setdefault(agent_id, []).append(entry)
        for route in state.routes.values():
            for subscription in route.subscriptions:
                state.subscribers.setdefault(subscription, set()).add(route.agent_id)
        return state

    # -- queries -------------------------------------------------------------------------

    def inbox(
        self,
        agent_id: str,
        after: int = 0,
        limit: int | None = None,
        *,
        now: datetime | None = None,
    ) -> list[InboxEntry]:
        """The entries of an agent's inbox after position `after`; given `now`, only those
        up to the first one the message rate holds back until later."""
        entries = self.inboxes.get(agent_id, [])[max(after, 0) :]
        if now is not None:
            entries = list(takewhile(lambda entry: not entry.held_at(now), entries))
        return entries if limit is None else entries[:limit]

    def held_back(self, agent_id: str, after: int, now: datetime) -> InboxEntry | None:
        """The first entry after position `after` that the message rate holds back at `now`."""
        entries = self.inboxes.get(agent_id, [])[max(after, 0) :]
        return next((entry for entry in entries if entry.held_at(now)), None)

    def ancestors(self, agent_id: str) -> list[str]:
        """The agent's ancestors, root first (without the agent)."""
        return self.tree.path(agent_id)[:-1]

    def descendants(self, agent_id: str) -> list[str]:
        """Every agent below this one, depth first (without the agent)."""
        return [node.agent_id for node in self.tree.subtree(agent_id)[1:]]

    def pending_requests(
        self, *, tree_id: str | None = None, agent_id: str | None = None
    ) -> list[HitlRequest]:
        """Unanswered HITL requests, oldest first, of one tree or one agent (or all)."""
        out = [
            request
            for request in self.requests.values()
            if request.pending
            and (tree_id is None or request.tree_id == tree_id)
            and (agent_id is None or request.agent_id == agent_id)
        ]
        return sorted(out, key=lambda request: request.seq)

    # -- changes -------------------------------------------------------------------------

    def subscribe(self, agent_id: str, subscription: str) -> None:
        """Add a subscription to an agent's route (once)."""
        route = self.routes[agent_id]
        if subscription in route.subscriptions:
            return
        route.subscriptions.append(subscription)
        self.subscribers.setdefault(subscription, set()).add(agent_id)
        self.touch(f"route:{agent_id}")

    def deliver(self, agent_id: str, entry: InboxEntry) -> None:
        """Put an entry into a running agent's inbox, or hold it until the agent runs."""
        route = self.routes[agent_id]
        if route.running:
            self._append(route, entry)
        else:
            route.held.append(entry)
        self.touch(f"route:{agent_id}")

    def _append(self, route: Route, entry: InboxEntry) -> None:
        route.delivered += 1
        entry.index = route.delivered
        self.inboxes.setdefault(route.agent_id, []).append(entry)
        self.touch(f"inbox:{route.agent_id}:{entry.index}")
        self.woken.add(route.agent_id)

    def start(self, agent_id: str, moment: datetime | None) -> None:
        """The agent runs: deliver what was held for it, highest priority first."""
        route = self.routes[agent_id]
        route.running = True
        held, route.held = route.held, []
        for entry in sorted(held, key=lambda e: (-e.priority, e.seq)):
            if not entry.expired_at(moment):
                self._append(route, entry)
        self.touch(f"route:{agent_id}")


#: The version of what `evolve` keeps: bumped by a change to the fold that changes its state,
#: so that a projection stored by the previous one is rebuilt from the log at start.
FOLD_VERSION = "1"


def fold_version(message_rate: float | None) -> str:
    """The version of the fold under `global.max_message_rate`: the rate decides each message's
    `not_before`, so a projection folded under another rate is rebuilt from the log at start,
    as any replay of the log under the rate in force would fold it."""
    if message_rate is None:
        return FOLD_VERSION
    return f"{FOLD_VERSION} max_message_rate={float(message_rate)!r}"


def evolve(
    state: RouterState, recorded: Recorded, message_rate: float | None = None
) -> RouterState:
    """Fold one event into the router's state; `message_rate` is `global.max_message_rate`."""
    event = recorded.event
    if state.woken:
        state.woken.clear()
    state.paced_s = 0.0
    state.refused = None
    known = event.agent_id in state.tree.agents
    state.tree = evolve_tree(state.tree, recorded)
    # Each kind told by its class itself, as in `grove_core.tree.evolve`; the commonest first.
    if type(event) is StatusEvent:
        _on_status(state, event, recorded.seq)
    elif type(event) is SpawnEvent:
        if not known:
            _on_spawn(state, event)
    elif type(event) is TerminateEvent:
        if not known:
            state.refused = (
                f"terminate of {event.agent_id}, an agent the log never spawned or forked"
            )
            return state
        route = state.routes.get(event.agent_id)
        if route is not None:
            route.running = False
            state.touch(f"route:{event.agent_id}")
        _route(state, event, recorded.seq, _terminate_addresses(state, event))
    elif type(event) is MessageEvent:
        not_before = _pace(state, recorded.stored_at or event.timestamp, message_rate)
        addresses = _message_addresses(state, event)
        _route(state, event, recorded.seq, addresses, not_before=not_before)
    elif type(event) is ForkEvent:
        if not known and event.agent_id in state.tree.agents:
            _on_fork(state, event)
    elif type(event) is ControlEvent:
        _on_control(state, event, recorded.seq)
    elif type(event) is HitlEvent:
        _on_hitl(state, event, recorded.seq)
    return state


def _new_route(state: RouterState, agent_id: str, permissions: list[str] | None) -> None:
    state.routes[agent_id] = Route(agent_id=agent_id, permissions=permissions)
    state.touch(f"route:{agent_id}")


def _parent_permissions(state: RouterState, parent: str | None) -> list[str] | None:
    route = state.routes.get(parent) if parent else None
    return None if route is None else route.permissions


def _auto_subscribe(
    state: RouterState, agent_id: str, parent: str | None, subscribe_parent: bool
) -> None:
    state.subscribe(agent_id, f"agent:{agent_id}")
    if parent is not None and parent in state.routes:
        state.subscribe(agent_id, f"lineage:{agent_id}")
        if subscribe_parent:
            state.subscribe(parent, f"subtree:{agent_id}")


def _on_spawn(state: RouterState, event: SpawnEvent) -> None:
    permissions = effective_permissions(
        _parent_permissions(state, event.parent), event.config.permissions
    )
    _new_route(state, event.agent_id, permissions)
    _auto_subscribe(state, event.agent_id, event.parent, event.subscribe_parent)
    for subscription in event.subscriptions:
        state.subscribe(event.agent_id, subscription)


def _on_fork(state: RouterState, event: ForkEvent) -> None:
    """A fork is a sibling of its source. It holds its source's capabilities, narrowed by its
    own config's, and keeps its source's explicit subscriptions unless it names its own."""
    node = state.tree.agents[event.agent_id]
    source = state.routes.get(event.source_agent)
    source_permissions = None if source is None else source.permissions
    asked = event.config.permissions if event.config is not None else None
    _new_route(state, event.agent_id, effective_permissions(source_permissions, asked))
    _auto_subscribe(state, event.agent_id, node.parent, subscribe_parent=True)
    if event.subscriptions is not None:
        explicit = event.subscriptions
    elif source is not None:
        automatic = {f"agent:{source.agent_id}", f"lineage:{source.agent_id}"}
        explicit = [s for s in source.subscriptions if s not in automatic]
    else:
        explicit = []
    for subscription in explicit:
        state.subscribe(event.agent_id, subscription)


def _on_status(state: RouterState, event: StatusEvent, seq: int) -> None:
    route = state.routes.get(event.agent_id)
    if route is not None:
        if event.status_type == "started":
            state.start(event.agent_id, event.timestamp)
        cursor = event.payload.details.get(INBOX_CURSOR_DETAIL)
        if isinstance(cursor, int) and cursor > route.committed:
            route.committed = min(cursor, route.delivered)
            state.touch(f"route:{event.agent_id}")
    addresses = [f"task:{event.agent_id}"]
    if event.status_type in NOTICE_STATUSES:
        addresses.append(f"subtree:{event.agent_id}")
    _route(state, event, seq, addresses)


def _pace(state: RouterState, stored_at: datetime | None, rate: float | None) -> str | None:
    """When a message the log stored at `stored_at` may be read under the message rate (None:
    at once)."""
    if rate is None or stored_at is None:
        return None
    sent = _utc(stored_at).timestamp()
    release = state.pace.pace(sent, rate)
    state.touch(PACE_KEY)
    if release - sent < TIMESTAMP_RESOLUTION_S:
        return None
    state.paced_s = release - sent
    return datetime.fromtimestamp(release, UTC).isoformat()


def _on_control(state: RouterState, event: ControlEvent, seq: int) -> None:
    if event.action == "inject_message":
        _route(state, event, seq, [f"agent:{event.agent_id}"], injected=True)
    elif event.action in ("pause_all", "resume_all"):
        _route(state, event, seq, ["broadcast:all"])


def _on_hitl(state: RouterState, event: HitlEvent, seq: int) -> None:
    if event.action == "request":
        if event.request_id in state.requests:
            return
        node = state.tree.agents.get(event.agent_id)
        path = event.agent_path or state.tree.path(event.agent_id) or [event.agent_id]
        state.requests[event.request_id] = HitlRequest(
            request_id=event.request_id,
            agent_id=event.agent_id,
            tree_id=event.tree_id or (node.tree_id if node else path[0]),
            agent_path=list(path),
            kind=event.kind,
            prompt=event.prompt or "",
            options=list(event.options),
            summary=event.summary,
            capability=event.capability,
            seq=seq,
            asked_at=event.timestamp.isoformat() if event.timestamp else None,
        )
        state.touch(f"hitl:{event.request_id}")
        ancestors = state.ancestors(event.agent_id)
        addresses = [f"subtree:{a}" for a in [*ancestors, event.agent_id]]
        _route(state, event, seq, addresses, also=ancestors)
        return
    request = state.requests.get(event.request_id)
    if request is None:
        state.refused = f"answer to {event.request_id}, a request the log does not have"
        return
    if not request.pending:
        state.refused = f"second answer to {event.request_id}; the first one (seq "
        state.refused += f"{request.answer_seq}) stands"
        return
    state.refused = forged_answer(state, event, request)
    if state.refused is not None:
        return
    request.answer = event.answer
    request.by = event.by
    request.answer_seq = seq
    state.touch(f"hitl:{event.request_id}")
    route = state.routes.get(request.agent_id)
    if (
        route is not None
        and request.kind == "permission"
        and request.capability is not None
        and is_approval(event.answer or "")
        and request.capability not in route.granted
    ):
        route.granted.append(request.capability)
        state.touch(f"route:{request.agent_id}")
    _route(state, event, seq, [f"agent:{request.agent_id}"])


def forged_answer(state: RouterState, event: HitlEvent, request: HitlRequest) -> str | None:
    """Why an answer cannot be taken (None when it can): it was published about another agent
    than the asker, or an agent of another tree gave it. A person (a caller) may answer any."""
    if event.agent_id != request.agent_id:
        return f"answer to {request.request_id} was published about {event.agent_id}, not the asker"
    answerer = state.tree.agents.get(event.by) if event.by else None
    if answerer is not None and answerer.tree_id != request.tree_id:
        return (
            f"agent {event.by} of tree {answerer.tree_id} may not answer a question of "
            f"tree {request.tree_id}"
        )
    return None


def _message_addresses(state: RouterState, event: MessageEvent) -> list[str]:
    if event.to is not None:
        return [f"agent:{event.to}"]
    addresses = [f"topic:{event.topic}"]
    if event.topic == BROADCAST_TOPIC:
        addresses.append("broadcast:all")
    addresses += [f"lineage:{d}" for d in state.descendants(event.from_)]
    return addresses


def _terminate_addresses(state: RouterState, event: TerminateEvent) -> list[str]:
    descendants = state.descendants(event.agent_id)
    return [
        f"task:{event.agent_id}",
        f"subtree:{event.agent_id}",
        *(f"lineage:{d}" for d in descendants),
    ]


def author(event: Event) -> str | None:
    """The agent whose act an event records (None for a person's act)."""
    match event:
        case MessageEvent():
            return event.from_
        case ControlEvent():
            return event.issued_by
        case HitlEvent():
            return event.agent_id if event.action == "request" else None
    return event.agent_id


def _route(
    state: RouterState,
    event: Event,
    seq: int,
    addresses: list[str],
    *,
    injected: bool = False,
    also: list[str] | None = None,
    not_before: str | None = None,
) -> None:
    """Deliver an event to the subscribers of its addresses (and to `also`), once each, never
    back to its own author."""
    recipients: dict[str, str] = {}
    for address in addresses:
        subscribed = state.subscribers.get(address)
        if subscribed:  # most addresses have nobody (every status goes to `task:<agent>`)
            for agent_id in sorted(subscribed):
                recipients.setdefault(agent_id, address)
    for agent_id in also or ():
        recipients.setdefault(agent_id, "ancestor")
    if not recipients:
        return
    origin = author(event)
    priority = INJECTED_PRIORITY if injected else 0
    expires = None
    if isinstance(event, MessageEvent):
        priority = event.priority
        if event.ttl is not None and event.timestamp is not None:
            expires = (event.timestamp + timedelta(seconds=event.ttl)).isoformat()
    path = state.tree.path(origin) if origin is not None else []
    for agent_id, via in recipients.items():
        if agent_id == origin or agent_id not in state.routes:
            continue
        entry = InboxEntry(
            seq=seq,
            type=event.type,
            source=origin,
            agent_path=list(path),
            priority=priority,
            via=via,
            injected=injected,
            expires=expires,
            not_before=not_before,
        )
        state.deliver(agent_id, entry)

"""The router's application layer: fold the log into routes and inboxes, answer queries.

Queries are request-reply on `grove.rpc.router.<verb>`, JSON in and out (`grove_core.rpc`). A
request may carry `after_seq`: the router answers once it has folded the log at least that far
(so a caller who just appended an event sees it), or says it is behind. `inbox` long-polls: with `wait`, it
answers as soon as something is delivered after the cursor, or when the wait is over. An inbox
is served up to its first entry that `global.max_message_rate` holds back until later (the
fold gives each paced message its moment, `not_before`); the wall clock is read only here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from datetime import UTC, datetime
from functools import partial
from typing import Any

from prometheus_client import Counter, Gauge

from grove_core.config import load_config
from grove_core.log import EventLog
from grove_core.projection import ProjectionRunner, ProjectionStore
from grove_core.records import Recorded
from grove_core.rpc import RpcServer, behind
from grove_core.service import Service, run_service
from grove_core.settings import ServiceSettings
from grove_core.tree import AgentNode
from grove_router.domain import HitlRequest, InboxEntry, RouterState, evolve, fold_version

log = logging.getLogger(__name__)

NAME = "router"
#: The projection's name in the database (its rows: tree nodes, routes, inbox entries, requests).
PROJECTION = NAME
#: Longest long-poll of `inbox`, and longest wait for `after_seq`, in seconds.
MAX_WAIT_S = 25.0
MAX_LIMIT = 1000
#: The most agents one `tree` answer carries (about 300 bytes each).
MAX_TREE_AGENTS = 2000
DEFAULT_LIMIT = 100

DELIVERIES = Counter(
    "grove_router_inbox_wakeups_total", "Inboxes that grew, counted once per event folded."
)
HITL_PENDING = Gauge("grove_hitl_pending", "Questions for a human not answered yet.")
PACED = Counter(
    "grove_router_messages_paced_total",
    "Messages global.max_message_rate put off: delivered later, in log order.",
)
REFUSED = Counter(
    "grove_router_refused_events_total",
    "Valid events the router would not take: a forged or second HITL answer, the end of an "
    "agent the log never had.",
    ["kind"],
)

Answer = dict[str, Any]


class QueryError(ValueError):
    """A request the router cannot answer as asked; the message says what to change."""


def _text(request: dict[str, Any], name: str, *, required: bool = True) -> str | None:
    value = request.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value:
        raise QueryError(f"'{name}' must be a non-empty string")
    return value


def _number(request: dict[str, Any], name: str, default: float, top: float) -> float:
    value = request.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise QueryError(f"'{name}' must be a number of at least 0")
    return min(float(value), top)


def request_row(request: HitlRequest) -> Answer:
    """A HITL request as the router reports it."""
    return {**asdict(request), "pending": request.pending}


class Router:
    """Keeps the routing projection and answers the router's queries."""

    def __init__(
        self, event_log: EventLog, store: ProjectionStore, message_rate: float | None = None
    ) -> None:
        self.log = event_log
        self.runner: ProjectionRunner[RouterState] = ProjectionRunner(
            name=PROJECTION,
            log=event_log,
            store=store,
            state_type=RouterState,
            evolve=partial(evolve, message_rate=message_rate),
            after_event=self._after_event,
            on_caught_up=self._count_pending,
            fold_version=fold_version(message_rate),
        )
        self._inbox_waiters: dict[str, asyncio.Event] = {}
        self.verbs: dict[str, Callable[[dict[str, Any]], Awaitable[Answer]]] = {
            "inbox": self.inbox,
            "summary": self.summary,
            "hierarchy": self.hierarchy,
            "query": self.query,
            "hitl": self.hitl,
            "pending": self.pending,
            "permissions": self.permissions,
            "tree": self.tree,
        }
        self.rpc = RpcServer(
            NAME,
            self.verbs,
            wait_applied=self.wait_applied,
            refusals=(QueryError,),
        )

    @property
    def state(self) -> RouterState:
        """The current fold."""
        return self.runner.state

    async def _count_pending(self) -> None:
        HITL_PENDING.set(len(self.state.pending_requests()))

    async def _after_event(self, recorded: Recorded, live: bool) -> None:
        if recorded.event.type == "hitl":
            await self._count_pending()
        if self.state.paced_s > 0:
            PACED.inc()
        if self.state.refused is not None:
            REFUSED.labels(recorded.event.type).inc()
            log.warning(
                "refused %s at seq %s: %s", recorded.subject, recorded.seq, self.state.refused
            )
        for agent_id in self.state.woken:
            DELIVERIES.inc()
            waiter = self._inbox_waiters.pop(agent_id, None)
            if waiter is not None:
                waiter.set()

    async def wait_applied(self, seq: int, timeout: float | None = None) -> None:
        """Wait until the fold has reached `seq`; QueryError after `timeout` (at most, and by
        default, `MAX_WAIT_S`)."""
        timeout = MAX_WAIT_S if timeout is None else min(timeout, MAX_WAIT_S)
        if not await self.runner.reached(seq, timeout):
            raise QueryError(behind(NAME, self.runner.applied_seq, seq, timeout))

    # -- serving -----------------------------------------------------------------------------

    def _route_of(self, agent_id: str) -> None:
        if agent_id not in self.state.routes:
            raise QueryError(f"no agent {agent_id!r} in the router's view; `grove tree` lists them")

    # -- verbs -------------------------------------------------------------------------------

    async def inbox(self, request: dict[str, Any]) -> Answer:
        """{agent_id, after?, limit?, wait?} -> the inbox entries after position `after`
        (default: what the agent has committed), waiting up to `wait` seconds for one. Entries
        stop at the first one the message rate holds back (`paced_until`: when it may be read)."""
        agent_id = _text(request, "agent_id")
        assert agent_id is not None
        self._route_of(agent_id)
        after_value = request.get("after")
        if after_value is None:
            after = self.state.routes[agent_id].committed
        elif isinstance(after_value, int) and after_value >= 0:
            after = after_value
        else:
            raise QueryError("'after' must be a whole number of at least 0")
        limit = int(_number(request, "limit", DEFAULT_LIMIT, MAX_LIMIT)) or DEFAULT_LIMIT
        wait = _number(request, "wait", 0.0, MAX_WAIT_S)
        entries = await self._due_entries(agent_id, after, limit, wait)
        route = self.state.routes[agent_id]
        paced = self.state.held_back(agent_id, after, datetime.now(UTC))
        return {
            "agent_id": agent_id,
            "after": after,
            "entries": [asdict(entry) for entry in entries],
            "delivered": route.delivered,
            "committed": route.committed,
            "held": len(route.held),
            "paced_until": None if paced is None else paced.not_before,
        }

    async def _due_entries(
        self, agent_id: str, after: int, limit: int, wait: float
    ) -> list[InboxEntry]:
        """The entries after `after` that may be read now, waiting up to `wait` seconds for one
        to be delivered or for the moment of one the message rate holds back."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while True:
            now = datetime.now(UTC)
            entries = self.state.inbox(agent_id, after, limit, now=now)
            remaining = deadline - loop.time()
            if entries or remaining <= 0:
                return entries
            paced = self.state.held_back(agent_id, after, now)
            due = None if paced is None else paced.due_at()
            if due is not None:
                await asyncio.sleep(min(remaining, (due - now).total_seconds()))
                continue
            waiter = self._inbox_waiters.setdefault(agent_id, asyncio.Event())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(waiter.wait(), remaining)

    def _state_of(self, node: AgentNode) -> str:
        route = self.state.routes.get(node.agent_id)
        return "running" if route is not None and route.running else node.state

    async def summary(self, request: dict[str, Any]) -> Answer:
        """{agent_id} -> the agent's state, task, last status, children, pending questions,
        usage, place in the tree, capabilities and subscriptions."""
        agent_id = _text(request, "agent_id")
        assert agent_id is not None
        node = self.state.tree.agents.get(agent_id)
        if node is None:
            self._route_of(agent_id)
        assert node is not None
        route = self.state.routes.get(agent_id)
        return {
            "agent_id": agent_id,
            "tree_id": node.tree_id,
            "parent": node.parent,
            "agent_path": self.state.tree.path(agent_id),
            "state": self._state_of(node),
            "task": node.task,
            "runtime": node.runtime,
            "last_status": node.last_status,
            "summary": node.summary,
            "error": node.error,
            "fork_of": node.fork_of,
            "children": [
                {"agent_id": c, "state": self._state_of(self.state.tree.agents[c])}
                for c in node.children
                if c in self.state.tree.agents
            ],
            "pending_questions": [
                request_row(r) for r in self.state.pending_requests(agent_id=agent_id)
            ],
            "usage": {"tokens": node.tokens},
            "permissions": None if route is None else route.permissions,
            "granted": [] if route is None else route.granted,
            "subscriptions": [] if route is None else route.subscriptions,
            "inbox": {
                "delivered": 0 if route is None else route.delivered,
                "committed": 0 if route is None else route.committed,
                "held": 0 if route is None else len(route.held),
            },
        }

    def _nested(self, node: AgentNode, depth: int) -> Answer:
        out: Answer = {
            "agent_id": node.agent_id,
            "state": self._state_of(node),
            "task": node.task,
            "summary": node.summary,
            "children": [],
        }
        if depth > 0:
            out["children"] = [
                self._nested(self.state.tree.agents[c], depth - 1)
                for c in node.children
                if c in self.state.tree.agents
            ]
        return out

    async def tree(self, request: dict[str, Any]) -> Answer:
        """{agent_id?} -> the agents of that agent's subtree (default: of every tree) as the
        tree projection keeps them: agent_id, tree_id, parent, task, runtime, state,
        last_status, summary, error, children, spawn_seq, end_seq, tokens, fork_of."""
        agent_id = _text(request, "agent_id", required=False)
        if agent_id is not None and agent_id not in self.state.tree.agents:
            self._route_of(agent_id)
        nodes = (
            self.state.tree.subtree(agent_id)
            if agent_id is not None
            else list(self.state.tree.agents.values())
        )
        if len(nodes) > MAX_TREE_AGENTS:
            raise QueryError(
                f"{len(nodes)} agents are more than one answer holds ({MAX_TREE_AGENTS}); ask "
                "for one agent's subtree"
            )
        return {"agents": [asdict(node) for node in nodes]}

    async def hierarchy(self, request: dict[str, Any]) -> Answer:
        """{agent_id, depth?} -> the agent's tree from its root, nested, and the agent's path."""
        agent_id = _text(request, "agent_id")
        assert agent_id is not None
        if agent_id not in self.state.tree.agents:
            self._route_of(agent_id)
        depth = int(_number(request, "depth", 64, 64))
        path = self.state.tree.path(agent_id)
        root = self.state.tree.agents[path[0]]
        return {"agent_id": agent_id, "agent_path": path, "root": self._nested(root, depth)}

    async def hitl(self, request: dict[str, Any]) -> Answer:
        """{request_id} -> the request and, once given, its answer."""
        request_id = _text(request, "request_id")
        assert request_id is not None
        found = self.state.requests.get(request_id)
        if found is None:
            raise QueryError(f"no HITL request {request_id!r}; `grove pending` lists the open ones")
        return request_row(found)

    async def pending(self, request: dict[str, Any]) -> Answer:
        """{tree_id?, agent_id?} -> the unanswered requests, oldest first."""
        tree_id = _text(request, "tree_id", required=False)
        agent_id = _text(request, "agent_id", required=False)
        found = self.state.pending_requests(tree_id=tree_id, agent_id=agent_id)
        return {"requests": [request_row(r) for r in found]}

    async def permissions(self, request: dict[str, Any]) -> Answer:
        """{agent_id} -> its effective capabilities (null: all) and what was granted to it."""
        agent_id = _text(request, "agent_id")
        assert agent_id is not None
        self._route_of(agent_id)
        route = self.state.routes[agent_id]
        return {"agent_id": agent_id, "permissions": route.permissions, "granted": route.granted}

    async def query(self, request: dict[str, Any]) -> Answer:
        """{type: agents|hitl|subscribers, filter?, limit?} -> matching rows."""
        kind = _text(request, "type")
        where = request.get("filter") or {}
        if not isinstance(where, dict):
            raise QueryError("'filter' must be an object of field: value")
        limit = int(_number(request, "limit", DEFAULT_LIMIT, MAX_LIMIT)) or DEFAULT_LIMIT
        rows: list[Answer]
        if kind == "agents":
            rows = [
                {
                    "agent_id": n.agent_id,
                    "tree_id": n.tree_id,
                    "parent": n.parent,
                    "state": self._state_of(n),
                    "runtime": n.runtime,
                    "task": n.task,
                }
                for n in self.state.tree.agents.values()
            ]
        elif kind == "hitl":
            rows = [request_row(r) for r in sorted(self.state.requests.values(), key=_by_seq)]
        elif kind == "subscribers":
            rows = [
                {"subscription": s, "agents": sorted(agents)}
                for s, agents in sorted(self.state.subscribers.items())
                if agents
            ]
        else:
            raise QueryError(f"unknown query type {kind!r}; use agents, hitl or subscribers")
        matching = [row for row in rows if all(row.get(k) == v for k, v in where.items())]
        return {"type": kind, "rows": matching[:limit], "total": len(matching)}


def _by_seq(request: HitlRequest) -> int:
    return request.seq


async def setup(service: Service) -> None:
    """Start the router inside a service process."""
    assert service.log is not None
    store = ProjectionStore(service.settings.database_for(NAME))
    limits = load_config(service.settings.config_path()).resources
    router = Router(service.log, store, message_rate=limits.global_.max_message_rate)
    service.ready_checks.append(router.runner.ready)
    service.ready_checks.append(router.rpc.is_serving)
    service.spawn(router.runner.run(), "router-projection")
    await router.runner.caught_up.wait()
    await service.serve_rpc(router.rpc)


def main() -> None:
    """`python -m grove_router`."""
    run_service(NAME, setup, ServiceSettings())

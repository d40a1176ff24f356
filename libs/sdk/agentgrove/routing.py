"""The client side of routing: messages, inboxes, questions for a human, permissions.

Messages, injections, questions and answers are events appended to the log; the router
folds them into inboxes and answers queries on `grove.rpc.router.<verb>`. An inbox entry
names a stream sequence; the reader fetches the event itself from the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import json
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

import nats.errors
import nats.js.errors

from grove_core.log import APPEND_PATIENCE_S, EventLog, LogError
from grove_core.records import decode_record
from grove_events import (
    RPC_BEHIND,
    ControlEvent,
    Event,
    HitlEvent,
    InvalidEvent,
    MessageEvent,
    TerminateEvent,
    new_id,
    rpc_subject,
)

#: Seconds a router query may take before the client gives up (long-polls add their wait).
ROUTER_TIMEOUT_S = 5.0
#: Longest single long-poll of an agent's inbox reader, in seconds.
LONG_POLL_S = 5.0
#: How long past its wait a long-poll may take to come back before the reader asks again
#: (a router killed during a poll never answers it).
POLL_MARGIN_S = 2.0
#: Pause before asking again a router that did not answer (it may be restarting).
RETRY_S = 0.5
#: How long an agent's call that needs the router waits for a restarting one.
ROUTER_RESTART_S = 60.0
#: How long in all a query waits for the router to fold the log up to what it asks after.
FOLD_WAIT_S = 25.0
#: How long one such request lets the router wait for its fold (`after_seq_wait`); then the
#: router answers that it is behind, and it is asked again, up to `FOLD_WAIT_S` in all. So a
#: router that died with the request costs this and the request's margin, not the whole wait.
BEHIND_WAIT_S = 5.0

T = TypeVar("T")

log = logging.getLogger(__name__)


async def riding_out_restarts(
    call: Callable[[], Awaitable[T]], within: float = ROUTER_RESTART_S
) -> T:
    """`call()`, asked again while the router does not answer (a restart), for at most
    `within` seconds; then its RouterUnavailable goes to the caller."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        try:
            return await call()
        except RouterUnavailable:
            if loop.time() + RETRY_S > deadline:
                raise
            await asyncio.sleep(RETRY_S)


class RouterError(LogError):
    """The router refused a query or did not answer; the message says what to do."""


class RouterUnavailable(RouterError):
    """The router did not answer in time (it may be restarting)."""


class RouterBehind(RouterError):
    """The router has not folded the log as far as the query asked in time."""


class UnknownRequest(LookupError):
    """No HITL request has this id."""

    def __init__(self, request_id: str) -> None:
        super().__init__(f"no HITL request {request_id!r}; `grove pending` lists the open ones")
        self.request_id = request_id


class AlreadyAnswered(ValueError):
    """The HITL request has an answer already; the first answer stands."""

    def __init__(self, request_id: str, answer: str | None, by: str | None) -> None:
        who = f" by {by}" if by else ""
        super().__init__(
            f"HITL request {request_id!r} was already answered{who}: {answer!r}; "
            "`grove pending` lists the open ones"
        )
        self.request_id = request_id


class PermissionDenied(PermissionError):
    """A capability the agent does not hold was asked for and refused."""

    def __init__(self, agent_id: str, capability: str, answer: str) -> None:
        super().__init__(
            f"agent {agent_id} may not use {capability!r}: the request was refused ({answer!r})"
        )
        self.agent_id = agent_id
        self.capability = capability


@dataclass(frozen=True)
class InboxItem:
    """One event delivered to an agent's inbox, with where it came from."""

    index: int
    seq: int
    event: Event
    source: str | None
    agent_path: list[str]
    priority: int = 0
    via: str = ""
    injected: bool = False
    #: When a message's ttl runs out (None: never); an agent is not handed it after that.
    expires: datetime | None = None

    def expired_at(self, moment: datetime) -> bool:
        """Whether the entry's ttl ran out before `moment`."""
        return self.expires is not None and self.expires < moment

    @property
    def type(self) -> str:
        """The event's kind."""
        return self.event.type

    @property
    def text(self) -> str:
        """What the event says, as text for a model's context."""
        event = self.event
        match event:
            case MessageEvent():
                return event.content
            case ControlEvent():
                return event.message or event.reason or event.action
            case HitlEvent():
                return (event.answer if event.action == "response" else event.prompt) or ""
            case TerminateEvent():
                return event.result.summary or event.error or event.reason
        return getattr(getattr(event, "payload", None), "summary", "") or event.type


@dataclass
class Routing:
    """Routing operations over one connection, acting as `identity` (an agent or a caller)."""

    log: EventLog
    identity: str = "caller"

    # -- queries ---------------------------------------------------------------------------

    async def rpc(
        self, verb: str, request: dict[str, Any], timeout: float = ROUTER_TIMEOUT_S
    ) -> dict[str, Any]:
        """Ask the router; RouterError with its message when it refuses."""
        try:
            reply = await self.log.nc.request(
                rpc_subject("router", verb), json.dumps(request).encode(), timeout=timeout
            )
        except nats.errors.NoRespondersError:
            raise RouterUnavailable(
                f"no router is answering `{verb}` (restarting, or not running: `grove up`)"
            ) from None
        except (TimeoutError, nats.errors.TimeoutError):
            raise RouterUnavailable(
                f"the router did not answer `{verb}` within {timeout:g}s; is it running "
                "(`grove up`)?"
            ) from None
        answer: dict[str, Any] = json.loads(reply.data)
        if set(answer) == {"error"}:  # a refusal is the error alone
            if RPC_BEHIND in answer["error"]:
                raise RouterBehind(f"router: {answer['error']}")
            raise RouterError(f"router: {answer['error']}")
        return answer

    async def _after_fold(
        self, verb: str, request: dict[str, Any], after: int, timeout: float = ROUTER_TIMEOUT_S
    ) -> dict[str, Any]:
        """Ask once the router has folded the log up to `after`: each request lets it wait
        `BEHIND_WAIT_S` for that, and it is asked again while behind, up to `FOLD_WAIT_S`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + FOLD_WAIT_S
        asked = {**request, "after_seq": after, "after_seq_wait": BEHIND_WAIT_S}
        while True:
            try:
                return await self.rpc(verb, asked, timeout + BEHIND_WAIT_S)
            except RouterBehind:
                if loop.time() + BEHIND_WAIT_S > deadline:
                    raise

    async def _fresh(self, verb: str, request: dict[str, Any]) -> dict[str, Any]:
        """Ask once the router has folded everything in the log now."""
        return await self._after_fold(verb, request, await self.log.last_seq())

    async def summary(self, agent_id: str) -> dict[str, Any]:
        """`get_agent_summary`: state, task, last status, children, pending questions, usage."""
        return await self._fresh("summary", {"agent_id": agent_id})

    async def hierarchy(self, agent_id: str) -> dict[str, Any]:
        """`get_hierarchy`: the agent's tree from its root, nested, and the agent's path."""
        return await self._fresh("hierarchy", {"agent_id": agent_id})

    async def tree(self, agent_id: str | None = None) -> list[dict[str, Any]]:
        """The router's tree projection: the agents of one agent's subtree, or of every tree,
        as rows of `grove_core.tree.AgentNode`."""
        request = {} if agent_id is None else {"agent_id": agent_id}
        answer = await self._fresh("tree", request)
        rows: list[dict[str, Any]] = answer["agents"]
        return rows

    async def query(
        self, type: str, filter: dict[str, Any] | None = None, limit: int = 100
    ) -> list[dict[str, Any]]:
        """`query_index`: rows of `agents`, `hitl` or `subscribers` matching `filter`."""
        answer = await self._fresh("query", {"type": type, "filter": filter or {}, "limit": limit})
        rows: list[dict[str, Any]] = answer["rows"]
        return rows

    async def pending(
        self, *, tree_id: str | None = None, agent_id: str | None = None
    ) -> list[dict[str, Any]]:
        """Unanswered HITL requests, oldest first (of one tree or agent, or all)."""
        request = {k: v for k, v in (("tree_id", tree_id), ("agent_id", agent_id)) if v}
        answer = await self._fresh("pending", request)
        rows: list[dict[str, Any]] = answer["requests"]
        return rows

    async def request(self, request_id: str) -> dict[str, Any]:
        """One HITL request and its answer, if given; UnknownRequest when there is none."""
        try:
            return await self._fresh("hitl", {"request_id": request_id})
        except RouterError as exc:
            if "no HITL request" in str(exc):
                raise UnknownRequest(request_id) from None
            raise

    async def permissions(self, agent_id: str) -> tuple[list[str] | None, list[str]]:
        """An agent's effective capabilities (None: all) and those granted to it alone."""
        answer = await self._fresh("permissions", {"agent_id": agent_id})
        return answer["permissions"], list(answer["granted"])

    # -- events ----------------------------------------------------------------------------

    async def send(
        self,
        content: str,
        *,
        to: str | None = None,
        topic: str | None = None,
        priority: int = 0,
        ttl: float | None = None,
        requires_ack: bool = False,
        correlation_id: str | None = None,
        ack_of: str | None = None,
        tree_id: str | None = None,
        causation_id: str | None = None,
    ) -> str:
        """Send a message to an agent or a topic; returns its event id."""
        event = MessageEvent(
            event_id=new_id(),
            agent_id=self.identity,
            tree_id=tree_id,
            timestamp=datetime.now(UTC),
            causation_id=causation_id,
            correlation_id=correlation_id,
            from_=self.identity,
            to=to,
            topic=topic,
            content=content,
            priority=priority,
            ttl=ttl,
            requires_ack=requires_ack,
            ack_of=ack_of,
        )
        await self.log.append(event, patience=APPEND_PATIENCE_S)
        return event.event_id

    async def inject(self, agent_id: str, message: str) -> str:
        """Force a message into an agent's context, read before anything else in its inbox."""
        event = ControlEvent(
            event_id=new_id(),
            agent_id=agent_id,
            timestamp=datetime.now(UTC),
            action="inject_message",
            issued_by=self.identity if self.identity != "caller" else None,
            message=message,
        )
        await self.log.append(event, patience=APPEND_PATIENCE_S)
        return event.event_id

    async def ask(
        self,
        prompt: str,
        *,
        agent_path: list[str],
        tree_id: str | None,
        kind: str = "question",
        options: list[str] | None = None,
        summary: str | None = None,
        capability: str | None = None,
        request_id: str | None = None,
    ) -> str:
        """Publish a HITL request as the agent `identity`; returns its request id."""
        event = HitlEvent(
            event_id=new_id(),
            agent_id=self.identity,
            tree_id=tree_id,
            timestamp=datetime.now(UTC),
            action="request",
            request_id=request_id or new_id(),
            agent_path=agent_path,
            kind=kind,
            prompt=prompt,
            options=options or [],
            summary=summary,
            capability=capability,
        )
        await self.log.append(event, patience=APPEND_PATIENCE_S)
        return event.request_id

    async def answer(
        self, request_id: str, answer: str, by: str | None = None, event_id: str | None = None
    ) -> str:
        """Answer a pending HITL request; UnknownRequest or AlreadyAnswered otherwise.

        Given the `event_id` of an earlier attempt whose outcome is unknown (the log did not
        acknowledge it), a retry is stored at most once."""
        found = await self.request(request_id)
        if not found["pending"]:
            raise AlreadyAnswered(request_id, found["answer"], found["by"])
        answerer = by or self.identity
        if answerer != "caller":
            with contextlib.suppress(RouterError):
                tree = (await self.summary(answerer)).get("tree_id")
                if tree is not None and tree != found["tree_id"]:
                    raise PermissionError(
                        f"agent {answerer} is in tree {tree}; it cannot answer request "
                        f"{request_id} of tree {found['tree_id']}"
                    )
        event = HitlEvent(
            event_id=event_id or new_id(),
            agent_id=found["agent_id"],
            tree_id=found["tree_id"],
            timestamp=datetime.now(UTC),
            correlation_id=request_id,
            action="response",
            request_id=request_id,
            agent_path=found["agent_path"],
            kind=found["kind"],
            answer=answer,
            by=by or self.identity,
        )
        await self.log.append(event, patience=APPEND_PATIENCE_S)
        return event.event_id

    async def requests(
        self, tree_id: str | None = None, from_seq: int = 1
    ) -> AsyncGenerator[HitlEvent, None]:
        """Follow the log's HITL requests (of one tree, or all) from `from_seq`, as a caller
        watching the root sees them; answered or not (`pending` tells which are open)."""
        async for item in self.log.events(from_seq, subjects="grove.hitl.*", follow=True):
            event = getattr(item, "event", None)
            if (
                isinstance(event, HitlEvent)
                and event.action == "request"
                and (tree_id is None or event.agent_path[:1] == [tree_id])
            ):
                yield event

    async def wait_ack(self, message_id: str, timeout: float | None = None) -> MessageEvent:
        """The acknowledgement of a message sent with `requires_ack` (TimeoutError after
        `timeout` seconds)."""

        async def first() -> MessageEvent:
            async for item in self.log.events(1, subjects="grove.message.*", follow=True):
                event = getattr(item, "event", None)
                if isinstance(event, MessageEvent) and event.ack_of == message_id:
                    return event
            raise RouterError("stopped reading the log before the acknowledgement came")

        return await asyncio.wait_for(first(), timeout)

    # -- inboxes ---------------------------------------------------------------------------

    async def _event_at(self, seq: int) -> Event:
        record = await self.log.get_at(seq)
        if record is None:
            raise RouterError(f"stream sequence {seq} is no longer in the log")
        try:
            return decode_record(record).event
        except InvalidEvent as exc:
            raise RouterError(f"stream sequence {seq} is not a valid event: {exc}") from None

    async def inbox(
        self,
        agent_id: str,
        after: int | None = None,
        *,
        limit: int = 100,
        wait: float = 0.0,
        fresh: bool = False,
        margin: float = ROUTER_TIMEOUT_S,
    ) -> tuple[list[InboxItem], dict[str, Any]]:
        """Inbox entries of `agent_id` after position `after` (default: what it committed),
        waiting up to `wait` seconds for one; also the router's counts for the inbox.

        `fresh` waits until the router has folded everything in the log now; `margin` is how
        long past `wait` the answer may take.
        """
        request: dict[str, Any] = {"agent_id": agent_id, "limit": limit, "wait": wait}
        if after is not None:
            request["after"] = after
        if fresh:
            after_seq = await self.log.last_seq()
            answer = await self._after_fold("inbox", request, after_seq, margin + wait)
        else:
            answer = await self.rpc("inbox", request, timeout=margin + wait)
        items = [
            InboxItem(
                index=entry["index"],
                seq=entry["seq"],
                event=await self._event_at(entry["seq"]),
                source=entry["source"],
                agent_path=entry["agent_path"],
                priority=entry["priority"],
                via=entry["via"],
                injected=entry["injected"],
                expires=_moment(entry.get("expires")),
            )
            for entry in answer["entries"]
        ]
        return items, answer


def _moment(text: str | None) -> datetime | None:
    """An ISO 8601 time as an aware UTC datetime (None stays None)."""
    if text is None:
        return None
    moment = datetime.fromisoformat(text)
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


@dataclass(order=True)
class _Queued:
    rank: tuple[int, int]
    item: InboxItem = field(compare=False)


class InboxReader:
    """Reads one agent's inbox in order: injected messages first, then higher priority, then
    log order among what is waiting unread; the cursor is how far everything has been taken.

    A message whose ttl ran out before it is handed out is skipped (taken without being given
    to the agent), counted in `expired` and logged: a ttl holds for a running agent that reads
    late as it does for one that was not running when the message came.
    """

    def __init__(
        self,
        routing: Routing,
        agent_id: str,
        *,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.routing = routing
        self.agent_id = agent_id
        self.clock = clock
        #: Entries skipped because their ttl had run out when they would have been handed out.
        self.expired = 0
        self._fetched: int | None = None
        self._buffer: list[_Queued] = []
        self._lock = asyncio.Lock()

    @property
    def cursor(self) -> int:
        """The position up to which every entry has been taken (what may be committed)."""
        if self._fetched is None:
            return 0
        if not self._buffer:
            return self._fetched
        return min(queued.item.index for queued in self._buffer) - 1

    async def _fill(self, wait: float) -> None:
        # The first read does not wait for new entries but for the router to fold the log up
        # to now (this instance's start included), so that what was held for the agent is there.
        first = self._fetched is None
        items, answer = await self.routing.inbox(
            self.agent_id,
            self._fetched,
            wait=0.0 if first else wait,
            fresh=first,
            margin=ROUTER_TIMEOUT_S if first else POLL_MARGIN_S,
        )
        if self._fetched is None:
            self._fetched = int(answer["after"])
        for item in items:
            # The router ranks an injected message above every priority.
            heapq.heappush(self._buffer, _Queued((-item.priority, item.index), item))
            self._fetched = max(self._fetched, item.index)

    def _drop_expired(self) -> None:
        """Take out of the buffer, unread, the entries whose ttl has run out by now."""
        now = self.clock()
        kept: list[_Queued] = []
        for queued in self._buffer:
            item = queued.item
            if not item.expired_at(now):
                kept.append(queued)
                continue
            self.expired += 1
            log.info(
                "inbox of %s: skipped message %s (seq %d) from %s: its ttl ran out at %s",
                self.agent_id,
                item.event.event_id,
                item.seq,
                item.source,
                item.expires,
            )
        if len(kept) < len(self._buffer):
            heapq.heapify(kept)
            self._buffer = kept

    async def available(self) -> list[InboxItem]:
        """Everything in the inbox now, in reading order, taken at once."""
        async with self._lock:
            await self._fill(0.0)
            self._drop_expired()
            return [heapq.heappop(self._buffer).item for _ in range(len(self._buffer))]

    async def next(
        self, timeout: float | None = None, match: Callable[[InboxItem], bool] | None = None
    ) -> InboxItem:
        """The next entry (the next one `match` accepts, leaving the others for later);
        TimeoutError after `timeout` seconds."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        async with self._lock:
            if self._buffer:
                # What came since the last read is ranked with what is still waiting: a
                # message of higher priority goes before older ones not read yet.
                with contextlib.suppress(RouterUnavailable):
                    await self._fill(0.0)
            while True:
                found = self._take(match)
                if found is not None:
                    return found
                remaining = LONG_POLL_S if deadline is None else deadline - loop.time()
                if remaining <= 0:
                    raise TimeoutError(f"nothing in the inbox of {self.agent_id} in time")
                try:
                    await self._fill(min(remaining, LONG_POLL_S))
                except RouterUnavailable:
                    # The inbox is in the log: a restarted router serves it again.
                    await asyncio.sleep(RETRY_S)

    def _take(self, match: Callable[[InboxItem], bool] | None) -> InboxItem | None:
        self._drop_expired()
        for queued in sorted(self._buffer):
            if match is None or match(queued.item):
                self._buffer.remove(queued)
                heapq.heapify(self._buffer)
                return queued.item
        return None

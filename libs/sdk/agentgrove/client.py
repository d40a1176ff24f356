"""GroveClient: spawn, stop and wait for agents from any Python program."""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import ssl
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import nats.errors

from agentgrove.artifacts import Artifacts
from agentgrove.results import AgentResult
from agentgrove.routing import Routing
from grove_core.auth import inbox_prefix
from grove_core.log import APPEND_PATIENCE_S, EventLog, LogError
from grove_core.records import Recorded
from grove_core.settings import DEFAULT_NATS_URL
from grove_core.tree import TreeState
from grove_core.tree import evolve as evolve_tree
from grove_events import (
    AgentConfig,
    ControlEvent,
    ForkEvent,
    InvalidEvent,
    SpawnEvent,
    StatusEvent,
    TerminateEvent,
    agent_wildcard,
    decode,
    new_id,
    rpc_subject,
    subject_for,
)

T = TypeVar("T")

URL_FILE = "nats.url"
#: Seconds a request to a service may take before the client gives up.
RPC_TIMEOUT_S = 5.0


class ServiceUnavailable(LogError):
    """A service did not answer a request in time."""

    def __init__(self, service: str, timeout: float) -> None:
        super().__init__(f"the {service} did not answer within {timeout:g}s; is it running?")
        self.service = service


class UnknownAgent(LookupError):
    """No event in the log names this agent."""

    def __init__(self, agent_id: str) -> None:
        super().__init__(f"no agent {agent_id!r} in the log; `grove tree` lists the agents")
        self.agent_id = agent_id


def discover_url(data_dir: Path | None = None) -> str:
    """Where the stack is: GROVE_NATS_URL, else the URL `grove up` wrote, else the default."""
    env = os.environ.get("GROVE_NATS_URL")
    if env:
        return env
    folder = data_dir or Path(os.environ.get("GROVE_DATA_DIR", ".grove"))
    url_file = folder / URL_FILE
    if url_file.exists():
        return url_file.read_text().strip()
    return DEFAULT_NATS_URL


def credentials_from_env() -> dict[str, Any]:
    """NATS connection options from GROVE_NATS_USER / GROVE_NATS_PASSWORD, GROVE_NATS_CREDS
    (a .creds file), GROVE_NATS_TLS_CA (a CA file: TLS) and GROVE_NATS_INBOX_PREFIX (where
    replies come back; default `_INBOX_producer` for the `producer` user, which may not
    subscribe to `_INBOX.>`); none set, none given.
    """
    options: dict[str, Any] = {}
    user = os.environ.get("GROVE_NATS_USER")
    if user:
        options["user"] = user
        options["password"] = os.environ.get("GROVE_NATS_PASSWORD", "")
    creds = os.environ.get("GROVE_NATS_CREDS")
    if creds:
        options["user_credentials"] = creds
    ca_file = os.environ.get("GROVE_NATS_TLS_CA")
    if ca_file:
        options["tls"] = ssl.create_default_context(cafile=ca_file)
    prefix = os.environ.get("GROVE_NATS_INBOX_PREFIX") or inbox_prefix(user)
    if prefix:
        options["inbox_prefix"] = prefix
    return options


def append_batch_from_env() -> int:
    """GROVE_APPEND_BATCH_FROM as a count (0 when unset); ValueError when it is not one."""
    value = os.environ.get("GROVE_APPEND_BATCH_FROM", "").strip() or "0"
    if not value.isdigit():
        raise ValueError(f"GROVE_APPEND_BATCH_FROM must be a count of appends, not {value!r}")
    return int(value)


def build_config(
    runtime: str,
    *,
    entrypoint: str | None = None,
    command: list[str] | None = None,
    **options: Any,
) -> AgentConfig:
    """An AgentConfig from keyword options (validated)."""
    return AgentConfig(runtime=runtime, entrypoint=entrypoint, command=command, **options)


class GroveClient:
    """An async client of AgentGrove over its event log."""

    def __init__(self, log: EventLog, *, identity: str = "caller") -> None:
        self.log = log
        self.identity = identity
        #: Messages, inboxes, HITL questions and answers, and the router's queries.
        self.routing = Routing(log, identity=identity)
        #: Artifacts of any tree, as a caller that is no agent (`Artifacts.put` needs an agent).
        self.artifacts = Artifacts(log)

    @classmethod
    async def connect(
        cls, url: str | None = None, *, append_batch_from: int | None = None, **options: Any
    ) -> GroveClient:
        """Connect to the stack (see `discover_url`; credentials: `credentials_from_env`).

        `append_batch_from` (default: GROVE_APPEND_BATCH_FROM, else 0) sends this client's
        appends in atomic batches once that many are unacknowledged, as the services do: for
        a producer that publishes bursts to a server that syncs every write.
        """
        batch_from = append_batch_from_env() if append_batch_from is None else append_batch_from
        if batch_from < 0:
            raise ValueError(f"append_batch_from must be 0 or more, not {batch_from}")
        options = {**credentials_from_env(), **options}
        log = await EventLog.connect(url or discover_url(), name="grove-client", **options)
        log.acks.batch_from = batch_from
        return cls(log)

    async def close(self) -> None:
        """Close the connection."""
        await self.log.close()

    async def __aenter__(self) -> GroveClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def spawn(
        self,
        task: str,
        config: AgentConfig,
        *,
        parent: str | None = None,
        tree_id: str | None = None,
        agent_id: str | None = None,
        causation_id: str | None = None,
        subscriptions: list[str] | None = None,
        subscribe_parent: bool = True,
        initial_context: str | None = None,
    ) -> str:
        """Publish a spawn event; returns the new agent's id."""
        agent_id = agent_id or new_id()
        event = SpawnEvent(
            event_id=new_id(),
            agent_id=agent_id,
            tree_id=tree_id,
            timestamp=datetime.now(UTC),
            causation_id=causation_id,
            task=task,
            parent=parent,
            config=config,
            subscriptions=subscriptions or [],
            subscribe_parent=subscribe_parent,
            initial_context=initial_context,
        )
        await self.log.append(event, patience=APPEND_PATIENCE_S)
        return agent_id

    async def exists(self, agent_id: str) -> bool:
        """Whether the log has any event about this agent."""
        return await self.log.get_last(agent_wildcard(agent_id)) is not None

    async def _control(self, agent_id: str, action: str, **fields: Any) -> str:
        if not await self.exists(agent_id):
            raise UnknownAgent(agent_id)
        event = ControlEvent(
            event_id=new_id(),
            agent_id=agent_id,
            timestamp=datetime.now(UTC),
            action=action,
            issued_by=self.identity if self.identity != "caller" else None,
            **fields,
        )
        await self.log.append(event, patience=APPEND_PATIENCE_S)
        return event.event_id

    async def stop(self, agent_id: str, reason: str = "stopped by caller") -> str:
        """Ask for an agent to be stopped; returns the control event's id."""
        return await self._control(agent_id, "stop", reason=reason)

    async def resume(self, agent_id: str, message: str | None = None) -> str:
        """Ask for a stopped agent to run again on its session, with `message` as the next
        user entry; returns the control event's id."""
        return await self._control(agent_id, "resume", message=message)

    async def fork(
        self,
        source_agent: str,
        reason: str,
        *,
        task: str | None = None,
        initial_message: str | None = None,
        config: AgentConfig | None = None,
        subscriptions: list[str] | None = None,
    ) -> str:
        """Fork an agent: a new agent in the same tree that starts from a copy of the source's
        session. The source is not told and goes on. Returns the new agent's id."""
        origin = await self._origin(source_agent)
        if origin is None:
            raise UnknownAgent(source_agent)
        agent_id = new_id()
        event = ForkEvent(
            event_id=new_id(),
            agent_id=agent_id,
            tree_id=await self._tree_of(source_agent, origin),
            timestamp=datetime.now(UTC),
            source_agent=source_agent,
            source_session=origin.session_id,
            reason=reason,
            task=task,
            initial_message=initial_message,
            subscriptions=subscriptions,
            config=config,
        )
        await self.log.append(event, patience=APPEND_PATIENCE_S)
        return agent_id

    async def _origin(self, agent_id: str) -> SpawnEvent | ForkEvent | None:
        """The event that created the agent: its spawn, or its fork."""
        for kind in ("spawn", "fork"):
            raw = await self.log.get_last(subject_for(kind, agent_id))
            if raw is None:
                continue
            try:
                event = decode(raw.subject, raw.data, raw.timestamp)
            except InvalidEvent:
                continue
            if isinstance(event, SpawnEvent | ForkEvent):
                return event
        return None

    async def _tree_of(self, agent_id: str, origin: SpawnEvent | ForkEvent) -> str | None:
        """The agent's tree: as its latest status gives it (the services resolve it), else as
        its origin says (null: the services resolve it from the log)."""
        raw = await self.log.get_last(subject_for("status", agent_id))
        if raw is not None:
            try:
                status = decode(raw.subject, raw.data, raw.timestamp)
            except InvalidEvent:
                status = None
            if isinstance(status, StatusEvent) and status.tree_id is not None:
                return status.tree_id
        return origin.tree_id

    async def resource_status(
        self, agent_id: str | None = None, timeout: float = RPC_TIMEOUT_S
    ) -> dict[str, Any]:
        """The governor's answer to `get_resource_status`: `global` (agents running, capacity,
        utilization, queued, paused) and, for an agent the governor tracks, `self` (its children
        running and limit, runtime elapsed, tokens)."""
        body = json.dumps({"agent_id": agent_id} if agent_id else {}).encode()
        try:
            reply = await self.log.nc.request(
                rpc_subject("governor", "status"), body, timeout=timeout
            )
        except (TimeoutError, nats.errors.NoRespondersError):
            raise ServiceUnavailable("resource-governor", timeout) from None
        answer: dict[str, Any] = json.loads(reply.data)
        if agent_id is not None and "self" not in answer:
            raise UnknownAgent(agent_id)
        return answer

    async def send(self, content: str, *, to: str | None = None, **options: Any) -> str:
        """Send a message to an agent (`to`) or a topic (`topic=`); returns its event id.
        Options: topic, priority, ttl, requires_ack, correlation_id."""
        if to is not None and not await self.exists(to):
            raise UnknownAgent(to)
        return await self.routing.send(content, to=to, **options)

    async def inject_message(self, agent_id: str, message: str) -> str:
        """Force a message into an agent's context (it reads it first); returns the event id."""
        if not await self.exists(agent_id):
            raise UnknownAgent(agent_id)
        return await self.routing.inject(agent_id, message)

    async def pending(self, tree_id: str | None = None) -> list[dict[str, Any]]:
        """Open HITL requests (questions and permission requests), oldest first."""
        return await self.routing.pending(tree_id=tree_id)

    async def answer(self, request_id: str, answer: str) -> str:
        """Answer a HITL request; it reaches exactly the agent that asked."""
        return await self.routing.answer(request_id, answer)

    async def wait(self, agent_id: str, timeout: float | None = None) -> AgentResult:
        """Wait for the agent's terminate event; TimeoutError after `timeout` seconds. A failed
        agent's result carries what its `failed` status says it attempted and had done."""
        recorded = await self.log.wait_for(subject_for("terminate", agent_id), timeout)
        event = recorded.event
        if not isinstance(event, TerminateEvent):
            raise LogError(f"unexpected event on the terminate subject of {agent_id}")
        failure = await self._failure_before(recorded) if event.reason == "failed" else None
        return AgentResult.from_event(event, failure)

    async def _failure_before(self, terminate: Recorded) -> StatusEvent | None:
        """The agent's `failed` status when it is its last status before this terminate."""
        raw = await self.log.get_last(subject_for("status", terminate.event.agent_id))
        if raw is None or raw.seq > terminate.seq:
            return None
        try:
            status = decode(raw.subject, raw.data, raw.timestamp)
        except InvalidEvent:
            return None
        if isinstance(status, StatusEvent) and status.status_type == "failed":
            return status
        return None

    async def summary(self, agent_id: str) -> dict[str, Any]:
        """An agent's state, task, last status, children, pending questions and usage."""
        return await self.routing.summary(agent_id)

    async def hierarchy(self, agent_id: str) -> dict[str, Any]:
        """The agent's tree from its root, nested, and the agent's path in it."""
        return await self.routing.hierarchy(agent_id)

    async def watch(
        self,
        tree_id: str | None = None,
        *,
        agent_id: str | None = None,
        kinds: Iterable[str] | None = None,
        from_seq: int | None = None,
    ) -> AsyncIterator[Recorded]:
        """Events as they are appended, forever (stop iterating to stop watching).

        `tree_id` (a root agent's id) keeps the events of that tree's agents, `agent_id` those
        of one agent, `kinds` those of some kinds (spawn, status...). From `from_seq`, or from
        the next event appended. Membership of a tree is folded from the log, so a child that
        names no tree of its own is counted in its parent's.
        """
        if tree_id is not None and agent_id is not None:
            raise ValueError("watch one tree (tree_id) or one agent (agent_id), not both")
        wanted = None if kinds is None else set(kinds)
        start = from_seq if from_seq is not None else await self.log.last_seq() + 1
        tree = TreeState()
        subjects = agent_wildcard(agent_id) if agent_id is not None else "grove.>"
        async for item in self.log.events(1 if tree_id else start, subjects=subjects, follow=True):
            if not isinstance(item, Recorded):
                continue
            if tree_id is not None:
                tree = evolve_tree(tree, item)
                node = tree.agents.get(item.event.agent_id)
                if node is None or node.tree_id != tree_id:
                    continue
            if item.seq < start or (wanted is not None and item.event.type not in wanted):
                continue
            yield item


class SyncGroveClient:
    """GroveClient for scripts without asyncio: the same methods, called without `await`.

    An event loop runs in a thread of its own for the client's life; `close()` (or leaving a
    `with` block) stops it. `watch` is not offered here: it needs an async iterator.
    """

    def __init__(self, url: str | None = None, **options: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._client: GroveClient = self._call(GroveClient.connect(url, **options))

    def _call(self, work: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(work, self._loop).result()

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._client, name)
        if name.startswith("_") or name == "watch" or not inspect.iscoroutinefunction(method):
            raise AttributeError(f"SyncGroveClient has no method {name!r}")

        def call(*args: Any, **kwargs: Any) -> Any:
            return self._call(method(*args, **kwargs))

        call.__doc__ = method.__doc__
        return call

    def close(self) -> None:
        """Close the connection and stop the client's event loop."""
        try:
            self._call(self._client.close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()

    def __enter__(self) -> SyncGroveClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""AgentContext: what a `python` agent is handed to do its work and manage its children."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal, Protocol, get_args

from agentgrove.client import GroveClient
from agentgrove.results import AgentResult
from grove_core.log import EventLog
from grove_events import AgentConfig, SpawnEvent, StatusEvent, StatusPayload, new_id

EntryKind = Literal["system", "user", "assistant", "tool_call", "tool_result"]
ENTRY_KINDS: tuple[str, ...] = get_args(EntryKind)

StartKind = Literal["spawn", "fork", "resume"]

#: Status types by which an agent says it has ended.
END_STATUSES = frozenset({"completed", "failed"})


@dataclass(frozen=True, slots=True)
class SessionEntry:
    """One entry of a session's transcript.

    `kind` is who or what it is: `system` (instructions, fork context), `user` (messages in:
    the task, a resume message), `assistant` (messages out), `tool_call`, `tool_result`.
    `agent_id` is the agent that wrote it (for a fork's copy: the source).
    """

    kind: EntryKind
    content: str
    time: datetime
    agent_id: str | None = None


def check_entry_kind(kind: str) -> EntryKind:
    """`kind` as an EntryKind; ValueError naming the valid kinds otherwise."""
    if kind not in ENTRY_KINDS:
        raise ValueError(f"session entry kind {kind!r} is not one of {', '.join(ENTRY_KINDS)}")
    return kind  # type: ignore[return-value]


class AgentSession(Protocol):
    """A session's transcript as the running agent sees it: read, and appended to."""

    @property
    def entries(self) -> list[SessionEntry]:
        """Entries so far, oldest first."""
        ...

    async def record(self, kind: EntryKind, content: str) -> SessionEntry:
        """Append an entry (persisted before this returns, where the session is stored)."""
        ...


class MemorySession:
    """A session kept in memory only: for agents run outside a spawner, and for tests."""

    def __init__(self, agent_id: str, entries: list[SessionEntry] | None = None) -> None:
        self.agent_id = agent_id
        self._entries = list(entries or [])

    @property
    def entries(self) -> list[SessionEntry]:
        """Entries so far, oldest first."""
        return list(self._entries)

    async def record(self, kind: EntryKind, content: str) -> SessionEntry:
        """Append an entry."""
        entry = SessionEntry(check_entry_kind(kind), content, datetime.now(UTC), self.agent_id)
        self._entries.append(entry)
        return entry


class AgentContext:
    """The running agent's view of AgentGrove: its task, session, status reports, children.

    While the system is paused (`control pause_all`), the calls that act on AgentGrove
    (`report` and the statuses built on it, `record`, `report_usage`, `spawn_agent`,
    `fork_agent`, `stop_agent`) wait until it resumes; `pause_point()` waits the same way
    for an agent that wants to stop at a safe place of its own.
    """

    def __init__(
        self,
        log: EventLog,
        spawn: SpawnEvent,
        tree_id: str,
        *,
        session: AgentSession | None = None,
        start: StartKind = "spawn",
        resume_message: str | None = None,
        tokens: int = 0,
    ) -> None:
        self._log = log
        self._spawn = spawn
        self._client = GroveClient(log, identity=spawn.agent_id)
        self._session: AgentSession = session or MemorySession(spawn.agent_id)
        self._running = asyncio.Event()
        self._running.set()
        self.tree_id = tree_id
        #: How this instance began: a spawn, a fork of another agent, or a resume.
        self.start: StartKind = start
        #: The message this instance was resumed with (None unless resumed with one).
        self.resume_message = resume_message
        #: Tokens used by the agent so far, over all its instances.
        self.tokens = tokens
        #: Whether the agent itself reported `completed` or `failed`.
        self.reported_end = False
        #: What the agent has tried so far (reported on failure as `attempted`).
        self.attempted: list[str] = []
        #: Results it already has (reported on failure as `partial_results`).
        self.partial_results: list[str] = []
        #: Children spawned by this agent, in order.
        self.children: list[str] = []

    @property
    def agent_id(self) -> str:
        """This agent's id."""
        return self._spawn.agent_id

    @property
    def session_id(self) -> str:
        """This agent's session."""
        return self._spawn.session_id or self._spawn.agent_id

    @property
    def parent(self) -> str | None:
        """The parent agent, None for a root."""
        return self._spawn.parent

    @property
    def task(self) -> str:
        """What this agent is to do."""
        return self._spawn.task

    @property
    def config(self) -> AgentConfig:
        """How this agent was configured."""
        return self._spawn.config

    @property
    def fork_of(self) -> str | None:
        """The agent this one is a fork of, or None."""
        return self._spawn.fork_from

    # -- the session ------------------------------------------------------------------------

    @property
    def history(self) -> list[SessionEntry]:
        """The session's entries so far, oldest first.

        For a resumed agent, everything of its earlier instances and the resume message; for a
        fork, the copy of the source's session and the fork-context entry.
        """
        return self._session.entries

    async def record(self, kind: str, content: str) -> SessionEntry:
        """Append an entry to this agent's session (kind: system, user, assistant, tool_call,
        tool_result)."""
        await self.pause_point()
        return await self._session.record(check_entry_kind(kind), content)

    # -- pausing ----------------------------------------------------------------------------

    @property
    def paused(self) -> bool:
        """Whether the system has paused this agent."""
        return not self._running.is_set()

    def pause(self) -> None:
        """Hold the agent at its next AgentGrove call (used by the spawner)."""
        self._running.clear()

    def unpause(self) -> None:
        """Let a paused agent go on (used by the spawner)."""
        self._running.set()

    async def pause_point(self) -> None:
        """Wait here while the agent is paused; return at once otherwise."""
        await self._running.wait()

    # -- reporting --------------------------------------------------------------------------

    async def report(self, status_type: str, summary: str = "", **details: Any) -> None:
        """Publish a status about this agent (checkpoint, blocked, discovery, completed...).

        The agent's token count so far goes along as `details["tokens"]` once it is known.
        """
        await self.pause_point()
        if self.tokens and "tokens" not in details:
            details["tokens"] = self.tokens
        await self._log.append(
            StatusEvent(
                event_id=new_id(),
                agent_id=self.agent_id,
                session_id=self.session_id,
                tree_id=self.tree_id,
                timestamp=datetime.now(UTC),
                causation_id=self._spawn.event_id,
                status_type=status_type,
                payload=StatusPayload(summary=summary, details=details),
            )
        )
        if status_type in END_STATUSES:
            self.reported_end = True

    async def report_usage(self, tokens: int, summary: str = "") -> None:
        """Count `tokens` more used and publish the total (a checkpoint with details.tokens).

        The governor enforces `max_tokens` from these totals.
        """
        if tokens < 0:
            raise ValueError(f"tokens used must be 0 or more, not {tokens}")
        self.tokens += tokens
        await self.report("checkpoint", summary or f"{self.tokens} tokens used")

    async def checkpoint(self, summary: str, **details: Any) -> None:
        """Report progress; it also counts as something attempted."""
        self.attempted.append(summary)
        await self.report("checkpoint", summary, **details)

    async def blocked(self, summary: str, **details: Any) -> None:
        """Report that the agent cannot go on without something."""
        await self.report("blocked", summary, **details)

    async def discovery(self, summary: str, **details: Any) -> None:
        """Report something found that others may want to know."""
        await self.report("discovery", summary, **details)

    # -- other agents -----------------------------------------------------------------------

    async def spawn_agent(
        self,
        task: str,
        *,
        runtime: str = "python",
        entrypoint: str | None = None,
        command: list[str] | None = None,
        **options: Any,
    ) -> str:
        """Spawn a child of this agent; returns its id."""
        await self.pause_point()
        config = AgentConfig(
            runtime=runtime,
            entrypoint=entrypoint,
            command=command,
            **options,
        )
        child = await self._client.spawn(
            task,
            config,
            parent=self.agent_id,
            tree_id=self.tree_id,
            causation_id=self._spawn.event_id,
        )
        self.children.append(child)
        return child

    async def fork_agent(
        self,
        reason: str,
        *,
        source: str | None = None,
        task: str | None = None,
        initial_message: str | None = None,
        config: AgentConfig | None = None,
        subscriptions: list[str] | None = None,
    ) -> str:
        """Fork an agent (by default this one); returns the fork's id. The source goes on."""
        await self.pause_point()
        return await self._client.fork(
            source or self.agent_id,
            reason,
            task=task,
            initial_message=initial_message,
            config=config,
            subscriptions=subscriptions,
        )

    async def wait(self, agent_id: str, timeout: float | None = None) -> AgentResult:
        """Wait for an agent (usually a child) to end."""
        return await self._client.wait(agent_id, timeout)

    async def stop_agent(self, agent_id: str, reason: str = "stopped by parent") -> None:
        """Stop an agent (usually a child)."""
        await self.pause_point()
        await self._client.stop(agent_id, reason)

"""AgentContext: what a `python` agent is handed to do its work and manage its children."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any, Literal, Protocol, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agentgrove.artifacts import Artifact, Artifacts
from agentgrove.client import GroveClient
from agentgrove.profiles import (
    SubAgentDefinition,
    SubAgentResult,
    UnknownSubagentType,
    check_task_arguments,
    load_profiles,
    subagent_result,
)
from agentgrove.results import AgentResult
from agentgrove.routing import (
    InboxItem,
    InboxReader,
    PermissionDenied,
    Routing,
    UnknownRequest,
    riding_out_restarts,
)
from grove_core.log import APPEND_PATIENCE_S, EventLog, LogError
from grove_events import (
    AgentConfig,
    HitlEvent,
    MessageEvent,
    SpawnEvent,
    StatusEvent,
    StatusPayload,
    new_id,
)

EntryKind = Literal["system", "user", "assistant", "tool_call", "tool_result"]
ENTRY_KINDS: tuple[str, ...] = get_args(EntryKind)

StartKind = Literal["spawn", "fork", "resume"]

#: Status types by which an agent says it has ended.
END_STATUSES = frozenset({"completed", "failed"})
#: How much of its task an agent's question for a human carries as its summary.
ASK_SUMMARY_CHARS = 300


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
        self._routing = Routing(log, identity=spawn.agent_id)
        self._inbox = InboxReader(self._routing, spawn.agent_id)
        self._artifacts = Artifacts(log, agent_id=spawn.agent_id)
        #: Capabilities as the router last said: the effective set (None: all), and grants.
        self._capabilities: tuple[list[str] | None, set[str]] | None = None

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

        The agent's token count so far goes along as `details["tokens"]` once it is known, and
        how far it has read its inbox as `details["inbox_cursor"]` (what a later instance of the
        agent does not read again).
        """
        await self.pause_point()
        if self.tokens and "tokens" not in details:
            details["tokens"] = self.tokens
        if self._inbox.cursor and "inbox_cursor" not in details:
            details["inbox_cursor"] = self._inbox.cursor
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
            ),
            patience=APPEND_PATIENCE_S,
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
        """Spawn a child of this agent; returns its id. Needs the `spawn` capability (see
        `require_permission`)."""
        await self.pause_point()
        await self.require_permission("spawn", f"spawn a child to: {task[:200]}")
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

    # -- messages and the inbox -------------------------------------------------------------

    async def send_message(
        self,
        content: str,
        *,
        to: str | None = None,
        topic: str | None = None,
        priority: int = 0,
        ttl: float | None = None,
        requires_ack: bool = False,
        correlation_id: str | None = None,
    ) -> str:
        """Send a message to an agent (`to`) or a topic; returns its event id.

        Higher `priority` (-10..10) is read first among what the recipient has not read; a
        message whose `ttl` (seconds) has run out before the recipient reads it is not handed to
        it. With `requires_ack`, the recipient acknowledges it as it takes it: a message back to
        this agent whose `ack_of` is this message's id, with the same `correlation_id`.
        """
        await self.pause_point()
        return await self._routing.send(
            content,
            to=to,
            topic=topic,
            priority=priority,
            ttl=ttl,
            requires_ack=requires_ack,
            correlation_id=correlation_id,
            tree_id=self.tree_id,
            causation_id=self._spawn.event_id,
        )

    async def inject_message(self, agent_id: str, message: str) -> str:
        """Force a message into an agent's (usually a child's) context: it reads it first."""
        await self.pause_point()
        return await self._routing.inject(agent_id, message)

    async def next_message(self, timeout: float | None = None) -> InboxItem:
        """The next entry of this agent's inbox, waiting for one (TimeoutError after
        `timeout` seconds). Injected messages come first, then higher priority, then log order;
        messages whose ttl has run out are skipped (see `expired_messages`). A message that
        `requires_ack` is acknowledged as it is taken."""
        item = await self._inbox.next(timeout)
        await self._acknowledge(item)
        return item

    @property
    def expired_messages(self) -> int:
        """Messages this instance skipped unread because their ttl had run out."""
        return self._inbox.expired

    async def inbox(self) -> list[InboxItem]:
        """Everything in this agent's inbox now, in reading order, taken at once (without the
        messages whose ttl has run out)."""
        items = await self._inbox.available()
        for item in items:
            await self._acknowledge(item)
        return items

    async def _acknowledge(self, item: InboxItem) -> None:
        event = item.event
        if isinstance(event, MessageEvent) and event.requires_ack and event.ack_of is None:
            await self._routing.send(
                f"ack {event.event_id}",
                to=event.from_,
                ack_of=event.event_id,
                correlation_id=event.correlation_id,
                tree_id=self.tree_id,
                causation_id=event.event_id,
            )

    # -- questions for a human, and permissions ----------------------------------------------

    async def ask_human(
        self, prompt: str, options: list[str] | None = None, timeout: float | None = None
    ) -> str:
        """Ask the caller a question and wait for the answer (TimeoutError after `timeout`
        seconds; the question stays open).

        The question travels up the tree with a short summary of this agent's task (never its
        transcript) and the answer comes back to this agent only. A question asked by an
        earlier instance of this agent and still unanswered when it stopped is not asked
        again: the resumed agent, asking the same, gets that question's answer.
        """
        await self.pause_point()
        return await self._ask("question", prompt, options or [], None, timeout)

    async def has_permission(self, capability: str) -> bool:
        """Whether this agent holds `capability` (by its spawn's permissions or a grant)."""
        if self._capabilities is None or not _holds(self._capabilities, capability):
            permissions, granted = await riding_out_restarts(
                lambda: self._routing.permissions(self.agent_id)
            )
            self._capabilities = (permissions, set(granted))
        return _holds(self._capabilities, capability)

    async def require_permission(self, capability: str, reason: str = "") -> None:
        """Go on only with `capability`: when the agent does not hold it, ask for it up the
        tree (a `permission` HITL request) and wait; PermissionDenied when refused."""
        if await self.has_permission(capability):
            return
        prompt = f"agent {self.agent_id} asks for the capability {capability!r}"
        answer = await self._ask(
            "permission",
            prompt + (f": {reason}" if reason else ""),
            ["approve", "deny"],
            capability,
            None,
        )
        self._capabilities = None
        if not await self.has_permission(capability):
            raise PermissionDenied(self.agent_id, capability, answer)

    async def _ask(
        self,
        kind: str,
        prompt: str,
        options: list[str],
        capability: str | None,
        timeout: float | None,
    ) -> str:
        request_id = self._open_question(kind, prompt, capability)
        if request_id is None:
            # Recorded before it is published: a stop in between leaves an open question that
            # the next instance publishes under the same id.
            request_id = new_id()
            asked = {"tool": "ask_human", "request_id": request_id, "kind": kind, "prompt": prompt}
            if capability is not None:
                asked["capability"] = capability
            await self._session.record("tool_call", json.dumps(asked))
            published = False
        else:
            published = await riding_out_restarts(lambda: self._published(request_id))
        if not published:
            hierarchy = await riding_out_restarts(lambda: self._routing.hierarchy(self.agent_id))
            await self._routing.ask(
                prompt,
                agent_path=hierarchy["agent_path"],
                tree_id=self.tree_id,
                kind=kind,
                options=options,
                summary=_clip(self.task, ASK_SUMMARY_CHARS),
                capability=capability,
                request_id=request_id,
            )

        def is_answer(item: InboxItem) -> bool:
            event = item.event
            return (
                isinstance(event, HitlEvent)
                and event.action == "response"
                and event.request_id == request_id
            )

        item = await self._inbox.next(timeout, match=is_answer)
        response = item.event
        assert isinstance(response, HitlEvent)
        answer = response.answer or ""
        await self._session.record(
            "tool_result",
            json.dumps(
                {"tool": "ask_human", "request_id": request_id, "answer": answer, "by": response.by}
            ),
        )
        return answer

    async def _published(self, request_id: str) -> bool:
        """Whether the log has the request (the router has folded the log up to now)."""
        try:
            await self._routing.request(request_id)
        except UnknownRequest:
            return False
        return True

    def _open_question(self, kind: str, prompt: str, capability: str | None) -> str | None:
        """The request id of the same question asked in this session and not answered yet."""
        asked: dict[str, dict[str, Any]] = {}
        for entry in self.history:
            if entry.kind not in ("tool_call", "tool_result"):
                continue
            try:
                data = json.loads(entry.content)
            except ValueError:
                continue
            if not isinstance(data, dict) or data.get("tool") != "ask_human":
                continue
            if entry.kind == "tool_call":
                asked[str(data.get("request_id"))] = data
            else:
                asked.pop(str(data.get("request_id")), None)
        for request_id, data in reversed(asked.items()):
            if (data.get("kind"), data.get("prompt"), data.get("capability")) == (
                kind,
                prompt,
                capability,
            ):
                return request_id
        return None

    # -- the tree, as the router sees it -----------------------------------------------------

    async def get_agent_summary(self, agent_id: str | None = None) -> dict[str, Any]:
        """An agent's (default: this one's) state, task, last status, children, pending
        questions and usage."""
        return await self._routing.summary(agent_id or self.agent_id)

    async def get_hierarchy(self, agent_id: str | None = None) -> dict[str, Any]:
        """The tree of an agent (default: this one) from its root, nested, and its path."""
        return await self._routing.hierarchy(agent_id or self.agent_id)

    async def query_index(
        self, type: str, filter: dict[str, Any] | None = None, limit: int = 100
    ) -> list[dict[str, Any]]:
        """Rows of the router's index: `agents`, `hitl` or `subscribers`, matching `filter`."""
        return await self._routing.query(type, filter, limit)

    async def get_resource_status(self) -> dict[str, Any]:
        """The governor's `get_resource_status`: `global` (agents running, capacity,
        utilization) and `self` (this agent's children running and limit, runtime, tokens)."""
        return await self._client.resource_status(self.agent_id)

    # -- artifacts ---------------------------------------------------------------------------

    async def put_artifact(
        self,
        data: bytes | str,
        name: str,
        media_type: str | None = None,
        *,
        put_id: str | None = None,
    ) -> Artifact:
        """Store `data` as an artifact of this agent (text as UTF-8 `text/plain`); its
        `artifact_id` is the handle to pass on. Any agent of this tree can read it.

        `put_id` (an id the agent chose) makes the put safe to try again: a put that failed
        without saying whether it was stored, repeated under the same `put_id`, is stored once.
        """
        await self.pause_point()
        return await self._artifacts.put(data, name=name, media_type=media_type, put_id=put_id)

    async def get_artifact(self, artifact_id: str) -> bytes:
        """The bytes of an artifact of this agent's tree (a child's result handle, say); an
        artifact of another tree is refused."""
        return await self._artifacts.get(artifact_id)

    async def list_artifacts(self, owner: str | None = None) -> list[Artifact]:
        """The live artifacts of this agent's tree, oldest first (`owner`: one agent's)."""
        return await self._artifacts.list(owner=owner)

    # -- delegating to subagent profiles (the `task` tool) -----------------------------------

    #: The profiles `delegate` uses, once read (see `subagent_profiles`).
    _profiles: dict[str, SubAgentDefinition] | None = None

    def subagent_profiles(self) -> dict[str, SubAgentDefinition]:
        """The subagent profiles: the built-ins and the config file's `profiles:` (read once,
        from GROVE_CONFIG_FILE or `grove.yaml` in the data folder)."""
        if self._profiles is None:
            self._profiles = load_profiles()
        return self._profiles

    async def delegate(self, description: str, prompt: str, subagent_type: str) -> SubAgentResult:
        """The `task` tool: run a child of the profile `subagent_type` on `prompt`, wait for
        its end and return its report (`description`, 1-120 characters, labels it; `prompt`,
        1-100,000 characters, is the child's whole brief). Several may run at once
        (`asyncio.gather`). A child that does not finish gives a result with `stop` whose
        content begins with a notice that the report is incomplete; stopping this agent while
        it waits stops the child. Needs the `spawn` capability."""
        check_task_arguments(description, prompt)
        profiles = self.subagent_profiles()
        profile = profiles.get(subagent_type)
        if profile is None:
            raise UnknownSubagentType(subagent_type, profiles)
        await self.pause_point()
        await self.require_permission("spawn", f"delegate to {subagent_type}: {description}")
        child = await self._client.spawn(
            prompt,
            profile.agent_config(),
            parent=self.agent_id,
            tree_id=self.tree_id,
            causation_id=self._spawn.event_id,
            initial_context=profile.system_prompt or None,
        )
        self.children.append(child)
        await self.checkpoint(
            f"task {subagent_type}: {description}", child=child, subagent_type=subagent_type
        )
        try:
            result = await self.wait(child)
        except asyncio.CancelledError:
            await self._client.stop(child, f"{self.agent_id} stopped while waiting for it")
            raise
        return subagent_result(
            result,
            parent_session_id=self.session_id,
            subagent_type=subagent_type,
            budget=profile.return_budget,
        )


def _holds(capabilities: tuple[list[str] | None, set[str]], capability: str) -> bool:
    permissions, granted = capabilities
    return permissions is None or capability in permissions or capability in granted


def _clip(text: str, width: int) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 3] + "..."


# -- the control tools, as a model calls them (the `openai` runtime, `grove mcp`) --------------

#: Bytes of an artifact the get_artifact tool returns as text.
ARTIFACT_TEXT_CHARS = 100_000
#: Errors a tool reports back to the model (its arguments or the situation), not crashes.
TOOL_ERRORS: tuple[type[Exception], ...] = (
    ValueError,
    LookupError,
    PermissionError,
    TimeoutError,
    LogError,
)


class ToolArguments(BaseModel):
    """Arguments of a control tool; unknown ones are refused."""

    model_config = ConfigDict(extra="forbid")


class SpawnAgentArguments(ToolArguments):
    """Arguments of spawn_agent."""

    task: str = Field(description="What the child is to do: its whole brief.")
    runtime: Literal["openai", "python", "command", "acp"] = Field(
        default="openai",
        description="Where the child runs: 'openai' (a model like you), 'python' (needs "
        "entrypoint), 'command' or 'acp' (need command).",
    )
    entrypoint: str | None = Field(default=None, description="For python: 'module:function'.")
    command: list[str] | None = Field(default=None, description="For command/acp: the argv.")
    model: str | None = Field(default=None, description="For openai: the model name.")
    permissions: list[str] | None = Field(
        default=None, description="Capabilities for the child (default: yours)."
    )
    timeout: float | None = Field(default=None, gt=0, description="Seconds the child may run.")
    return_budget: int | None = Field(
        default=None, ge=1, description="Characters of result you get back (default 6000)."
    )


class ForkAgentArguments(ToolArguments):
    """Arguments of fork_agent."""

    reason: str = Field(description="Why the fork is made; the fork is told.")
    source: str | None = Field(default=None, description="Agent to fork (default: yourself).")
    task: str | None = Field(default=None, description="The fork's own task.")
    initial_message: str | None = Field(default=None, description="The fork's first message.")


class TaskArguments(ToolArguments):
    """Arguments of task."""

    description: str = Field(description="A short label of the delegated work, 1-120 characters.")
    prompt: str = Field(description="The subagent's whole brief, up to 100,000 characters.")
    subagent_type: str = Field(description="The profile to use (see the list above).")


class WaitArguments(ToolArguments):
    """Arguments of wait."""

    agent_id: str = Field(description="The agent to wait for, usually a child.")
    timeout: float | None = Field(default=None, gt=0, description="Seconds to wait at most.")


class StopAgentArguments(ToolArguments):
    """Arguments of stop_agent."""

    agent_id: str = Field(description="The agent to stop, usually a child.")
    reason: str = Field(default="stopped by parent", description="Why; kept in the log.")


class SendMessageArguments(ToolArguments):
    """Arguments of send_message."""

    content: str = Field(description="The message.")
    to: str | None = Field(default=None, description="An agent id (or give topic).")
    topic: str | None = Field(default=None, description="A topic name (or give to).")
    priority: int = Field(default=0, ge=-10, le=10, description="Higher is read first.")


class InjectMessageArguments(ToolArguments):
    """Arguments of inject_message."""

    agent_id: str = Field(description="The agent (usually a child) that must read it first.")
    message: str = Field(description="The message.")


class AgentArguments(ToolArguments):
    """Arguments of the tools about one agent (default: the caller)."""

    agent_id: str | None = Field(default=None, description="The agent (default: yourself).")


class NoArguments(ToolArguments):
    """No arguments."""


class AskHumanArguments(ToolArguments):
    """Arguments of ask_human."""

    prompt: str = Field(description="The question for the person in charge.")
    options: list[str] = Field(default_factory=list, description="Answers to choose from.")
    timeout: float | None = Field(default=None, gt=0, description="Seconds to wait at most.")


class PutArtifactArguments(ToolArguments):
    """Arguments of put_artifact."""

    name: str = Field(description="A file name for it, e.g. 'report.md'.")
    content: str = Field(description="The text to store.")
    media_type: str | None = Field(default=None, description="Default: text/plain.")


class ArtifactArguments(ToolArguments):
    """Arguments of get_artifact."""

    artifact_id: str = Field(description="The artifact's handle (from a result or a listing).")


class ListArtifactsArguments(ToolArguments):
    """Arguments of list_artifacts."""

    owner: str | None = Field(default=None, description="Only this agent's (default: all).")


class QueryIndexArguments(ToolArguments):
    """Arguments of query_index."""

    type: Literal["agents", "hitl", "subscribers"] = Field(description="What to list.")
    filter: dict[str, Any] | None = Field(default=None, description="Field values to match.")
    limit: int = Field(default=100, ge=1, le=1000, description="Rows at most.")


class ReadInboxArguments(ToolArguments):
    """Arguments of read_inbox."""

    wait: float = Field(
        default=0, ge=0, le=600, description="Seconds to wait for one entry when it is empty."
    )


def _inbox_entry(item: InboxItem) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "type": item.type,
        "from": item.source,
        "via": item.via,
        "text": item.text,
    }
    event = item.event
    if isinstance(event, StatusEvent) and event.status_type == "failed":
        # A child's failure: what it attempted and had done, for the parent to decide on.
        details = event.payload.details
        entry["status"] = "failed"
        for key in ("attempted", "partial_results"):
            if details.get(key):
                entry[key] = details[key]
    return entry


async def _spawn_tool(ctx: AgentContext, args: SpawnAgentArguments) -> dict[str, Any]:
    options = args.model_dump(
        exclude={"task", "runtime", "entrypoint", "command"}, exclude_none=True
    )
    child = await ctx.spawn_agent(
        args.task, runtime=args.runtime, entrypoint=args.entrypoint, command=args.command, **options
    )
    return {"agent_id": child}


async def _fork_tool(ctx: AgentContext, args: ForkAgentArguments) -> dict[str, Any]:
    fork = await ctx.fork_agent(
        args.reason, source=args.source, task=args.task, initial_message=args.initial_message
    )
    return {"agent_id": fork}


async def _task_tool(ctx: AgentContext, args: TaskArguments) -> dict[str, Any]:
    result = await ctx.delegate(args.description, args.prompt, args.subagent_type)
    return result.model_dump(exclude_none=True)


async def _wait_tool(ctx: AgentContext, args: WaitArguments) -> dict[str, Any]:
    result = await ctx.wait(args.agent_id, args.timeout)
    return {k: v for k, v in asdict(result).items() if v is not None}


async def _stop_tool(ctx: AgentContext, args: StopAgentArguments) -> dict[str, Any]:
    await ctx.stop_agent(args.agent_id, args.reason)
    return {"stopping": args.agent_id}


async def _send_tool(ctx: AgentContext, args: SendMessageArguments) -> dict[str, Any]:
    message = await ctx.send_message(
        args.content, to=args.to, topic=args.topic, priority=args.priority
    )
    return {"message_id": message}


async def _inject_tool(ctx: AgentContext, args: InjectMessageArguments) -> dict[str, Any]:
    return {"message_id": await ctx.inject_message(args.agent_id, args.message)}


async def _summary_tool(ctx: AgentContext, args: AgentArguments) -> dict[str, Any]:
    return await ctx.get_agent_summary(args.agent_id)


async def _hierarchy_tool(ctx: AgentContext, args: AgentArguments) -> dict[str, Any]:
    return await ctx.get_hierarchy(args.agent_id)


async def _resources_tool(ctx: AgentContext, args: NoArguments) -> dict[str, Any]:
    return await ctx.get_resource_status()


async def _ask_tool(ctx: AgentContext, args: AskHumanArguments) -> dict[str, Any]:
    return {"answer": await ctx.ask_human(args.prompt, args.options, args.timeout)}


async def _inbox_tool(ctx: AgentContext, args: ReadInboxArguments) -> dict[str, Any]:
    items = await ctx.inbox()
    if not items and args.wait > 0:
        try:
            items = [await ctx.next_message(args.wait)]
        except TimeoutError:
            items = []
    return {"entries": [_inbox_entry(item) for item in items]}


async def _put_artifact_tool(ctx: AgentContext, args: PutArtifactArguments) -> dict[str, Any]:
    artifact = await ctx.put_artifact(args.content, args.name, args.media_type)
    return asdict(artifact)


async def _get_artifact_tool(ctx: AgentContext, args: ArtifactArguments) -> dict[str, Any]:
    data = await ctx.get_artifact(args.artifact_id)
    text = data[:ARTIFACT_TEXT_CHARS].decode(errors="replace")
    return {
        "artifact_id": args.artifact_id,
        "text": text,
        "truncated": len(data) > ARTIFACT_TEXT_CHARS,
    }


async def _list_artifacts_tool(ctx: AgentContext, args: ListArtifactsArguments) -> dict[str, Any]:
    return {"artifacts": [asdict(a) for a in await ctx.list_artifacts(args.owner)]}


async def _query_tool(ctx: AgentContext, args: QueryIndexArguments) -> dict[str, Any]:
    return {"rows": await ctx.query_index(args.type, args.filter, args.limit)}


@dataclass(frozen=True)
class ControlTool:
    """One AgentContext call as a tool a model can call: name, description for a model, the
    arguments' JSON schema, and the call. Its result is JSON-serialisable."""

    name: str
    description: str
    arguments: type[ToolArguments]
    call: Callable[[AgentContext, Any], Awaitable[dict[str, Any]]]

    def parameters(self) -> dict[str, Any]:
        """The JSON schema of the arguments."""
        return self.arguments.model_json_schema()

    async def invoke(self, ctx: AgentContext, arguments: str | dict[str, Any]) -> dict[str, Any]:
        """Validate the arguments (JSON text or a dict) and run the call; one of TOOL_ERRORS,
        with a message for the model, when the arguments or the situation do not allow it."""
        try:
            if isinstance(arguments, str):
                args = self.arguments.model_validate_json(arguments or "{}")
            else:
                args = self.arguments.model_validate(arguments)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or 'arguments'}: {e['msg']}"
                for e in exc.errors(include_url=False)
            )
            raise ValueError(f"invalid arguments for {self.name}: {problems}") from None
        return await self.call(ctx, args)


def _task_description(profiles: Mapping[str, SubAgentDefinition]) -> str:
    listed = "\n".join(f"- {name}: {p.description}" for name, p in sorted(profiles.items()))
    return (
        "Delegate a self-contained piece of work to a subagent and wait for its report. The "
        "subagent starts fresh: it sees only `prompt`, so put everything it needs there. "
        "Several task calls in one turn run at the same time. The result's `content` is the "
        "report; when `stop` is present the subagent did not finish and the report is "
        "incomplete. Available subagent types:\n" + listed
    )


def control_tools(profiles: Mapping[str, SubAgentDefinition]) -> list[ControlTool]:
    """The control tools every agent sees, the `task` tool listing `profiles`."""
    return [
        ControlTool(
            "spawn_agent",
            "Start a child agent that works on its own; returns its agent_id at once. Use "
            "`wait` for its result (or `read_inbox`: its result arrives there), `stop_agent` "
            "to end it. Prefer `task` for a profile-based delegation you wait for.",
            SpawnAgentArguments,
            _spawn_tool,
        ),
        ControlTool(
            "fork_agent",
            "Fork an agent (default: yourself): a new agent that starts from a copy of the "
            "conversation so far and goes its own way; returns its agent_id.",
            ForkAgentArguments,
            _fork_tool,
        ),
        ControlTool("task", _task_description(profiles), TaskArguments, _task_tool),
        ControlTool(
            "wait",
            "Wait until an agent ends; returns its reason (completed, failed, stopped, "
            "timeout...), summary and error.",
            WaitArguments,
            _wait_tool,
        ),
        ControlTool(
            "stop_agent", "Stop an agent, usually a child.", StopAgentArguments, _stop_tool
        ),
        ControlTool(
            "send_message",
            "Send a message to an agent (`to`) or to a topic; returns its message_id.",
            SendMessageArguments,
            _send_tool,
        ),
        ControlTool(
            "inject_message",
            "Force a message into an agent's (usually a child's) context: it reads it first.",
            InjectMessageArguments,
            _inject_tool,
        ),
        ControlTool(
            "read_inbox",
            "Take what was delivered to you: messages, answers, your children's results and "
            "end notices. Give `wait` seconds to wait for one when nothing is there.",
            ReadInboxArguments,
            _inbox_tool,
        ),
        ControlTool(
            "get_agent_summary",
            "An agent's state, task, last status, children, pending questions and usage.",
            AgentArguments,
            _summary_tool,
        ),
        ControlTool(
            "get_hierarchy",
            "The agent tree from its root, nested, and the path to the agent.",
            AgentArguments,
            _hierarchy_tool,
        ),
        ControlTool(
            "get_resource_status",
            "System capacity and use (agents running, capacity, utilization) and your own: "
            "children running and their limit, runtime so far, tokens. Check it before "
            "spawning many children.",
            NoArguments,
            _resources_tool,
        ),
        ControlTool(
            "ask_human",
            "Ask the person in charge a question and wait for the answer. Only for what you "
            "cannot decide or find out yourself.",
            AskHumanArguments,
            _ask_tool,
        ),
        ControlTool(
            "query_index",
            "List rows of the tree's index: `agents` (state, parent, task), `hitl` (questions) "
            "or `subscribers`, matching `filter`.",
            QueryIndexArguments,
            _query_tool,
        ),
        ControlTool(
            "put_artifact",
            "Store a text (a report, a file) as an artifact; returns its artifact_id, the "
            "handle to pass to other agents instead of the whole text.",
            PutArtifactArguments,
            _put_artifact_tool,
        ),
        ControlTool(
            "get_artifact",
            "Read an artifact of your tree by its artifact_id, e.g. a child's full result when "
            "its summary was cut (the first 100,000 bytes, as text).",
            ArtifactArguments,
            _get_artifact_tool,
        ),
        ControlTool(
            "list_artifacts",
            "The artifacts of your tree (optionally one agent's), oldest first.",
            ListArtifactsArguments,
            _list_artifacts_tool,
        ),
    ]

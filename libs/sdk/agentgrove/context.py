"""AgentContext: what a `python` agent is handed to do its work and manage its children."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from agentgrove.client import GroveClient
from agentgrove.results import AgentResult
from grove_core.log import EventLog
from grove_events import AgentConfig, SpawnEvent, StatusEvent, StatusPayload, new_id


class AgentContext:
    """The running agent's view of AgentGrove: its task, status reports, and its children."""

    def __init__(self, log: EventLog, spawn: SpawnEvent, tree_id: str) -> None:
        self._log = log
        self._spawn = spawn
        self._client = GroveClient(log, identity=spawn.agent_id)
        self.tree_id = tree_id
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

    async def report(self, status_type: str, summary: str = "", **details: Any) -> None:
        """Publish a status about this agent (checkpoint, blocked, discovery...)."""
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

    async def wait(self, agent_id: str, timeout: float | None = None) -> AgentResult:
        """Wait for an agent (usually a child) to end."""
        return await self._client.wait(agent_id, timeout)

    async def stop_agent(self, agent_id: str, reason: str = "stopped by parent") -> None:
        """Stop an agent (usually a child)."""
        await self._client.stop(agent_id, reason)

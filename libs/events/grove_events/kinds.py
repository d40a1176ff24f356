"""Every kind of event on the GROVE stream, as frozen pydantic models (DESIGN §2)."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from grove_events.envelope import Envelope, Model, Token

Runtime = Literal["python", "command", "acp", "openai"]
StatusType = Literal[
    "queued",
    "admitted",
    "rejected",
    "started",
    "checkpoint",
    "blocked",
    "discovery",
    "completed",
    "failed",
    "stopped",
    "resumed",
    "timeout_notice",
    "paused",
]
TerminateReason = Literal["completed", "failed", "stopped", "timeout", "cancelled", "rejected"]
ControlAction = Literal["stop", "resume", "inject_message", "pause_all", "resume_all"]

SUBSCRIPTION_PATTERN = re.compile(
    r"^(agent|task|lineage|subtree):[A-Za-z0-9_-]{1,128}$|^topic:[A-Za-z0-9_.-]{1,128}$|^broadcast:all$"
)
ENTRYPOINT_PATTERN = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")

DEFAULT_RETURN_BUDGET = 6000


class GlobalLimits(Model):
    """Limits over the whole system."""

    max_concurrent_agents: int | None = Field(default=None, ge=1)
    max_spawn_rate: float | None = Field(default=None, gt=0, description="Spawns per second.")
    max_message_rate: float | None = Field(default=None, gt=0, description="Messages per second.")


class PerParentLimits(Model):
    """Limits on the children of one agent."""

    max_children: int | None = Field(default=None, ge=0)
    max_spawn_rate: float | None = Field(default=None, gt=0, description="Spawns per second.")


class PerAgentLimits(Model):
    """Limits on one agent."""

    max_runtime: float | None = Field(default=None, gt=0, description="Seconds.")
    max_tokens: int | None = Field(default=None, ge=1)


class PerTreeLimits(Model):
    """Limits on a whole tree, which no fork or nesting can bypass."""

    max_depth: int | None = Field(default=None, ge=0)
    max_agents: int | None = Field(default=None, ge=1)
    max_tokens: int | None = Field(default=None, ge=1)


class ResourceLimits(Model):
    """The shape of `ResourceConfig`; any subset may be given. A spawn's limits only tighten."""

    global_: GlobalLimits = Field(default_factory=GlobalLimits, alias="global")
    per_parent: PerParentLimits = Field(default_factory=PerParentLimits)
    per_agent: PerAgentLimits = Field(default_factory=PerAgentLimits)
    per_tree: PerTreeLimits = Field(default_factory=PerTreeLimits)


class AgentConfig(Model):
    """How to run an agent."""

    runtime: Runtime = Field(description="Where the agent runs.")
    entrypoint: str | None = Field(
        default=None, description="For runtime=python: 'module:function' of an async callable."
    )
    command: list[str] | None = Field(
        default=None, description="For runtime=command or acp: the argv to execute."
    )
    model: str | None = None
    profile: str | None = Field(default=None, description="A subagent profile name.")
    timeout: float | None = Field(default=None, gt=0, description="Seconds; null: no timeout.")
    resource_limits: ResourceLimits | None = None
    permissions: list[str] | None = Field(
        default=None, description="Capabilities asked for; null means the parent's."
    )
    return_budget: int = Field(
        default=DEFAULT_RETURN_BUDGET, ge=1, description="Characters of result summary."
    )

    @model_validator(mode="after")
    def _runtime_needs(self) -> AgentConfig:
        if self.runtime == "python":
            if not self.entrypoint or not ENTRYPOINT_PATTERN.fullmatch(self.entrypoint):
                raise ValueError(
                    "runtime 'python' needs config.entrypoint as 'package.module:function'"
                )
        elif self.runtime in ("command", "acp") and not self.command:
            raise ValueError(f"runtime {self.runtime!r} needs config.command, a non-empty argv")
        return self


def _check_subscriptions(values: list[str]) -> list[str]:
    for value in values:
        if not SUBSCRIPTION_PATTERN.fullmatch(value):
            raise ValueError(
                f"subscription {value!r} is not one of agent:ID, task:ID, lineage:ID, "
                "subtree:ID, topic:NAME, broadcast:all"
            )
    return values


class SpawnEvent(Envelope):
    """A request to create an agent. Published by any producer on `grove.spawn.<agent_id>`."""

    type: Literal["spawn"] = "spawn"
    task: str = Field(min_length=1, max_length=100_000, description="What the agent is to do.")
    parent: Token | None = Field(default=None, description="Parent agent; null for a root.")
    initial_context: str | None = None
    subscriptions: list[str] = Field(default_factory=list)
    subscribe_parent: bool = True
    config: AgentConfig
    fork_from: Token | None = Field(default=None, description="Source agent, for a fork.")

    _subs = field_validator("subscriptions")(_check_subscriptions)

    @model_validator(mode="after")
    def _root_is_its_own_tree(self) -> SpawnEvent:
        if self.parent is None and self.tree_id is None:
            object.__setattr__(self, "tree_id", self.agent_id)
        return self


class StatusPayload(Model):
    """What a status says: a short summary and details that depend on the status type."""

    summary: str = ""
    details: dict[str, Any] = Field(default_factory=dict)


class StatusEvent(Envelope):
    """A lifecycle fact or progress report, on `grove.status.<agent_id>`."""

    type: Literal["status"] = "status"
    schema_version: int = Field(default=2, ge=1, strict=True)
    status_type: StatusType
    payload: StatusPayload = Field(default_factory=StatusPayload)


class ForkEvent(Envelope):
    """A request to fork an agent: `agent_id`/`session_id` name the new agent."""

    type: Literal["fork"] = "fork"
    source_agent: Token
    source_session: Token | None = None
    reason: str = Field(min_length=1, max_length=2000)
    task: str | None = Field(default=None, max_length=100_000)
    initial_message: str | None = None
    subscriptions: list[str] | None = None
    config: AgentConfig | None = None

    @field_validator("subscriptions")
    @classmethod
    def _subs(cls, values: list[str] | None) -> list[str] | None:
        return None if values is None else _check_subscriptions(values)


class ResultSummary(Model):
    """An agent's result as its parent sees it: within its return budget."""

    summary: str = ""
    artifact: str | None = Field(default=None, description="Handle of the full result.")
    truncated: bool = False


class Usage(Model):
    """What an agent consumed."""

    tokens: int = Field(default=0, ge=0)
    runtime_s: float = Field(default=0.0, ge=0)


class TerminateEvent(Envelope):
    """The end of an agent instance, on `grove.terminate.<agent_id>`."""

    type: Literal["terminate"] = "terminate"
    reason: TerminateReason
    result: ResultSummary = Field(default_factory=ResultSummary)
    error: str | None = None
    usage: Usage = Field(default_factory=Usage)


class MessageEvent(Envelope):
    """A message from an agent or caller to an agent or a topic; `agent_id` is the sender."""

    type: Literal["message"] = "message"
    from_: Token = Field(alias="from")
    to: Token | None = None
    topic: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.-]{1,128}$")
    content: str = Field(max_length=1_000_000)
    requires_ack: bool = False
    ttl: float | None = Field(default=None, gt=0, description="Seconds after timestamp.")
    priority: int = Field(default=0, ge=-10, le=10)
    ack_of: Token | None = Field(
        default=None, description="For an acknowledgement: the event_id of the message it acks."
    )

    @model_validator(mode="after")
    def _one_target(self) -> MessageEvent:
        if (self.to is None) == (self.topic is None):
            raise ValueError("a message needs exactly one of 'to' (an agent) or 'topic'")
        return self


class ControlEvent(Envelope):
    """A command to an agent (`agent_id` is the target) or, for pause_all/resume_all, to all."""

    type: Literal["control"] = "control"
    action: ControlAction
    issued_by: Token | None = None
    message: str | None = Field(default=None, max_length=100_000)
    reason: str | None = Field(default=None, max_length=2000)

    @model_validator(mode="after")
    def _message_needed(self) -> ControlEvent:
        if self.action == "inject_message" and not self.message:
            raise ValueError("control action 'inject_message' needs 'message'")
        return self


class HitlEvent(Envelope):
    """A question for a human (`action=request`) or its answer (`action=response`)."""

    type: Literal["hitl"] = "hitl"
    action: Literal["request", "response"]
    request_id: Token
    agent_path: list[Token] = Field(default_factory=list, description="Root first, asker last.")
    kind: Literal["question", "permission"] = "question"
    prompt: str | None = Field(default=None, max_length=100_000)
    options: list[str] = Field(default_factory=list)
    summary: str | None = Field(default=None, max_length=2000)
    answer: str | None = Field(default=None, max_length=100_000)
    by: str | None = None
    capability: str | None = Field(
        default=None,
        pattern=r"^[a-z][a-z0-9_.-]{0,63}$",
        description="For kind=permission: the capability asked for (spawn, fs.read, shell...).",
    )

    @model_validator(mode="after")
    def _fields_for_action(self) -> HitlEvent:
        if self.action == "request" and not self.prompt:
            raise ValueError("a hitl request needs 'prompt'")
        if self.action == "response" and self.answer is None:
            raise ValueError("a hitl response needs 'answer'")
        return self


class ArtifactEvent(Envelope):
    """A stored artifact, published by the artifact-store only."""

    type: Literal["artifact"] = "artifact"
    action: Literal["put", "delete"] = "put"
    artifact_id: Token
    name: str = Field(min_length=1, max_length=512)
    media_type: str = "application/octet-stream"
    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


Event = Annotated[
    SpawnEvent
    | StatusEvent
    | ForkEvent
    | TerminateEvent
    | MessageEvent
    | ControlEvent
    | HitlEvent
    | ArtifactEvent,
    Field(discriminator="type"),
]

EVENT_CLASSES: dict[str, type[Envelope]] = {
    "spawn": SpawnEvent,
    "status": StatusEvent,
    "fork": ForkEvent,
    "terminate": TerminateEvent,
    "message": MessageEvent,
    "control": ControlEvent,
    "hitl": HitlEvent,
    "artifact": ArtifactEvent,
}

KINDS: tuple[str, ...] = tuple(EVENT_CLASSES)

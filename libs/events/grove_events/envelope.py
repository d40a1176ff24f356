"""The envelope every AgentGrove event carries, separate from its business payload."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Self

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

#: An id that can stand as one token of a NATS subject: no dots, wildcards or spaces.
ID_REGEX = r"^[A-Za-z0-9_-]{1,128}$"
TOKEN_PATTERN = re.compile(ID_REGEX)
#: What a token must be, in words (the decoder's reasons say this, not the pattern).
ID_RULE = (
    "must be 1-128 characters of letters, digits, '-' or '_' (it becomes a NATS subject token)"
)

#: An agent, session or tree id; producers choose them (the SDK makes UUIDv7s). The pattern is
#: checked by pydantic-core itself: a Python validator here cost a fifth of a microsecond per id,
#: on every event of every replay.
Token = Annotated[str, StringConstraints(pattern=ID_REGEX)]


class Model(BaseModel):
    """Base of every schema: immutable, strict about unknown fields."""

    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
        # JSON has no Infinity or NaN; a number that is one is refused, not stored (a state
        # row holding one could not be written back as JSON).
        allow_inf_nan=False,
        # Keys repeat from event to event, most values (ids, times) never: caching only the
        # keys saves the string cache's work on every value.
        cache_strings="keys",
    )


class Envelope(Model):
    """Fields on every event.

    A producer must send `event_id`, `type` and `agent_id`; every other envelope field has a
    default that is the same on every replay:

    - `session_id`: the `agent_id` (an agent's first session is named after it).
    - `tree_id`: for a root spawn, the `agent_id`; otherwise null, meaning "the tree of the
      agent's parent as recorded in the log" (consumers resolve it from the log, never guess).
    - `timestamp`: the stream's own timestamp of the stored message, filled in by the decoder.
    - `schema_version`: the version of the kind the producer wrote; older ones are upcast.
    - `causation_id`, `correlation_id`: null.
    """

    event_id: Token = Field(description="Unique id of this event (UUIDv7); also its Nats-Msg-Id.")
    agent_id: Token = Field(description="The agent this event is about; the subject's last token.")
    session_id: Token | None = Field(
        default=None, description="The agent's session; defaults to the agent_id."
    )
    tree_id: Token | None = Field(
        default=None,
        description="The root agent's id; null means: the parent's tree, as the log records it.",
    )
    timestamp: datetime | None = Field(
        default=None,
        description="UTC time of the fact; when missing, the stream's timestamp of the message.",
    )
    schema_version: int = Field(
        default=1, ge=1, strict=True, description="Version of this kind's schema."
    )
    causation_id: Token | None = Field(
        default=None, description="event_id of the event that caused this one."
    )
    correlation_id: Token | None = Field(
        default=None, description="Id shared by the events of one conversation or request."
    )

    @model_validator(mode="after")
    def _default_session(self) -> Self:
        # After validation, not before: a "before" hook would copy every event's input into a
        # Python dict and lose validation straight from the JSON bytes (twice as slow).
        if self.session_id is None:
            object.__setattr__(self, "session_id", self.agent_id)
        return self

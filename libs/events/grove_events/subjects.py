"""Subjects mirror the schemas: `grove.<kind>.<agent_id>`."""

from __future__ import annotations

from grove_events.kinds import KINDS

PREFIX = "grove"
DEADLETTER = f"{PREFIX}.deadletter"
RPC = f"{PREFIX}.rpc"


def subject_for(kind: str, agent_id: str) -> str:
    """The subject an event of `kind` about `agent_id` is published on."""
    if kind not in KINDS:
        raise ValueError(f"unknown event kind {kind!r}; known kinds: {', '.join(KINDS)}")
    return f"{PREFIX}.{kind}.{agent_id}"


def kind_wildcard(kind: str) -> str:
    """All subjects of one kind, e.g. `grove.spawn.*`."""
    return subject_for(kind, "*")


def agent_wildcard(agent_id: str) -> str:
    """All event subjects of one agent, `grove.*.<agent_id>`."""
    return f"{PREFIX}.*.{agent_id}"


def deadletter_subject(kind: str, seq: int) -> str:
    """Where the invalid message stored at `seq` is recorded (one subject per bad message)."""
    return f"{DEADLETTER}.{kind}.{seq}"


#: In the text of a request-reply refusal that says the service has not folded the log as far
#: as the request's `after_seq` in time: the caller may ask again.
RPC_BEHIND = "has not folded the log to seq"


def rpc_subject(service: str, verb: str) -> str:
    """A request-reply subject, `grove.rpc.<service>.<verb>` (not on the stream)."""
    return f"{RPC}.{service}.{verb}"


def parse_subject(subject: str) -> tuple[str, str] | None:
    """(kind, agent_id) of an event subject, or None when it is not one."""
    parts = subject.split(".")
    if len(parts) != 3 or parts[0] != PREFIX or parts[1] not in KINDS:
        return None
    return parts[1], parts[2]

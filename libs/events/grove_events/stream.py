"""The definition of the GROVE stream, the authoritative log. Services bind to it."""

from __future__ import annotations

from dataclasses import dataclass, field

from grove_events.kinds import KINDS
from grove_events.subjects import DEADLETTER, kind_wildcard

STREAM_NAME = "GROVE"


@dataclass(frozen=True)
class StreamDefinition:
    """What the GROVE stream is; `grove_core` turns it into a JetStream StreamConfig."""

    name: str = STREAM_NAME
    subjects: tuple[str, ...] = field(
        default_factory=lambda: (*(kind_wildcard(k) for k in KINDS), f"{DEADLETTER}.>")
    )
    storage: str = "file"
    #: A retried append with the same Nats-Msg-Id within this window is stored once.
    duplicate_window_s: float = 120.0
    #: Keep everything: the log is the source of truth. Operators may set limits.
    max_bytes: int = -1
    max_msgs: int = -1
    #: At a size limit, refuse new messages (producers are told) rather than drop old facts.
    discard: str = "new"
    replicas: int = 1


GROVE_STREAM = StreamDefinition()

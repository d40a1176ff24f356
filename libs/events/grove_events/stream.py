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
    #: Consumers the stream may have at once. Every replay and every wait for an agent's end
    #: is an ordered consumer while it lasts (a manager waiting on its children holds one per
    #: child); nats-server 2.15 allows a stream 1,000 unless the stream names its own limit
    #: (and reads 0 or -1 as "its default", not as "no limit").
    max_consumers: int = 100_000
    replicas: int = 1


GROVE_STREAM = StreamDefinition()

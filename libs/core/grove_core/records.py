"""Messages of the GROVE stream as records: their place in the log, read from a delivery.

No I/O here: the log (`grove_core.log`) and the replay reader (`grove_core.replay`) build these
from what nats-py hands them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import NamedTuple

from grove_events import Event, decode, subject_for
from grove_events.upcasting import current_version

# Records are named tuples, not frozen dataclasses: a replay makes two for every message, and
# a frozen dataclass's __init__ sets each field through object.__setattr__ (0.6 µs for a
# RawRecord, against 0.2 µs for the tuple).


class RawRecord(NamedTuple):
    """A message as stored on the stream, not yet decoded."""

    seq: int
    subject: str
    data: bytes
    timestamp: datetime
    headers: Mapping[str, str] | None = None
    #: For a consumer's delivery: how many messages matching it were still behind this one.
    pending: int = 0


class Recorded(NamedTuple):
    """A decoded event with its place in the log."""

    seq: int
    subject: str
    event: Event
    #: When the log stored it (the stream's time, to the millisecond): unlike the event's own
    #: timestamp, which its producer chose, the same for every reader and every replay. None
    #: for a record that did not come from the log.
    stored_at: datetime | None = None


def stream_time(value: datetime) -> datetime:
    """A stream time in UTC, to the millisecond."""
    # Two read paths (push metadata, direct get) parse the server time differently; whole
    # milliseconds make every replay decode to the same timestamp.
    value = value.astimezone(UTC)
    return value.replace(microsecond=value.microsecond // 1000 * 1000)


def _ack_fields(reply: str) -> list[str] | None:
    """(delivered, stream seq, consumer seq, time ns, pending) as text, from a consumer
    delivery's reply subject; None when the subject has another form.

    The forms (NATS ADR-15): `$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.
    <consumer seq>.<time ns>.<pending>`, and the same after `<domain>.<account hash>` (with a
    random last token or not).
    """
    tokens = reply.split(".")
    count = len(tokens)
    if count == 9:
        first = 4
    elif count in (11, 12):
        first = 6
    else:
        return None
    if tokens[0] != "$JS" or tokens[1] != "ACK":
        return None
    return tokens[first : first + 5]


def delivery_position(reply: str) -> tuple[int, int, int, datetime] | None:
    """(stream sequence, consumer sequence, messages pending, stream time to the millisecond)
    of a consumer's delivery, read from its reply subject (`_ack_fields`); None when the
    subject has another form. `Msg.metadata` reads the same fields but builds objects that
    cost more than the rest of a replay's step; this runs for every message of every replay.
    """
    fields = _ack_fields(reply)
    if fields is None:
        return None
    try:
        seq = int(fields[1])
        consumer_seq = int(fields[2])
        nanoseconds = int(fields[3])
        pending = int(fields[4])
    except ValueError:
        return None
    # Whole milliseconds over 1000 are within half a microsecond of exact as a float, to
    # which `fromtimestamp` rounds: the same moment as the epoch plus a timedelta, made faster.
    return seq, consumer_seq, pending, datetime.fromtimestamp(nanoseconds // 1_000_000 / 1000, UTC)


def decode_record(record: RawRecord) -> Recorded:
    """Decode a stored message (raises InvalidEvent)."""
    event = decode(record.subject, record.data, record.timestamp)
    return Recorded(record.seq, record.subject, event, record.timestamp)


def is_deadletter(subject: str) -> bool:
    """Dead-letter records share the stream but are not events."""
    return subject.startswith("grove.deadletter.")


class OwnAppends:
    """The events a connection appended lately, by the bytes of their bodies.

    A service folds its own events too: the spawner the `started`, `completed` and `terminate`
    of each agent it runs, the governor its decisions. Those bodies are the encoding of events
    the service holds already, so its projection takes the event from here instead of decoding
    the body again (about 4 µs each, three of the five events of an agent's life in the
    spawner). Events are kept by their encoded bytes, as they are sent: the stream may hand the
    message to the projection before its acknowledgement reaches the append, and a body equal
    to an event's encoding decodes to that event. Only what decoding would give is kept: a
    current, complete event (not one whose timestamp the decoder fills, or an older schema's).
    The newest `limit` are kept, each taken once; a body not found is decoded as usual.

    Nothing is kept until a reader asks for it (`keep`): a connection that only appends (a
    producer of spawns, the CLI) holds no events it would never read back.
    """

    def __init__(self) -> None:
        #: How many of the newest events are kept (0: none, until `keep`).
        self.limit = 0
        self._events: OrderedDict[bytes, Event] = OrderedDict()

    def keep(self, limit: int = 4096) -> None:
        """Keep the newest `limit` events appended from now on (a projection of this
        connection reads them)."""
        self.limit = max(self.limit, limit)

    def remember(self, data: bytes, event: Event) -> None:
        """`data`, the encoding of `event`, is about to be appended."""
        if not self.limit:
            return
        if event.timestamp is None or event.schema_version != current_version(event.type):
            return  # decoding fills or upcasts it: the decoder's event differs
        events = self._events
        events[data] = event
        if len(events) > self.limit:
            events.popitem(last=False)

    def recorded(self, record: RawRecord) -> Recorded | None:
        """The record as `decode_record` would give it, when its body is a remembered event's
        (which is then forgotten); None otherwise."""
        if not self._events:
            return None
        event = self._events.pop(record.data, None)
        if event is None or subject_for(event.type, event.agent_id) != record.subject:
            return None
        return Recorded(record.seq, record.subject, event, record.timestamp)

    def __len__(self) -> int:
        return len(self._events)

"""A service's projection takes the events it appended itself as they are, not decoded again."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from grove_core.records import OwnAppends, RawRecord, Recorded
from grove_events import (
    AgentConfig,
    Event,
    SpawnEvent,
    StatusEvent,
    TerminateEvent,
    decode,
    encode,
    new_id,
    subject_for,
)
from grove_events.kinds import ResultSummary, StatusPayload, Usage

pytestmark = pytest.mark.unit

NOW = datetime(2026, 12, 7, 1, 2, 3, 456789, tzinfo=UTC)
STORED_AT = datetime(2026, 12, 7, 1, 2, 3, 457000, tzinfo=UTC)


def _status(agent: str = "a1", timestamp: datetime | None = NOW) -> StatusEvent:
    return StatusEvent(
        event_id=new_id(),
        agent_id=agent,
        tree_id="root",
        timestamp=timestamp,
        causation_id=new_id(),
        status_type="started",
        payload=StatusPayload(summary="started on python", details={"runtime": "python"}),
    )


def _record(seq: int, event: Event) -> RawRecord:
    return RawRecord(seq, subject_for(event.type, event.agent_id), encode(event), STORED_AT)


EVENTS: list[Event] = [
    _status(),
    SpawnEvent(
        event_id=new_id(),
        agent_id="a2",
        timestamp=NOW,
        task="say hello",
        config=AgentConfig(runtime="python", entrypoint="pkg.mod:run", return_budget=100),
    ),
    TerminateEvent(
        event_id=new_id(),
        agent_id="a3",
        tree_id="root",
        timestamp=NOW,
        reason="completed",
        result=ResultSummary(summary="done", truncated=False),
        usage=Usage(tokens=12, runtime_s=0.25),
    ),
]


def _kept(event: Event, own: OwnAppends) -> None:
    """As an append does: remember the event with its encoding."""
    own.remember(encode(event), event)


@pytest.mark.parametrize("event", EVENTS, ids=lambda event: event.type)
def test_a_remembered_event_is_what_decoding_its_record_gives(event: Event) -> None:
    own = OwnAppends()
    own.keep()
    _kept(event, own)
    record = _record(7, event)
    recorded = own.recorded(record)
    assert recorded is not None
    assert recorded.event is event
    assert recorded == Recorded(7, record.subject, decode(record.subject, record.data), STORED_AT)
    assert own.recorded(record) is None  # taken once


def test_a_body_on_another_subject_is_decoded_as_usual() -> None:
    own = OwnAppends()
    own.keep()
    event = _status("a1")
    _kept(event, own)
    elsewhere = _record(7, event)._replace(subject=subject_for("status", "b1"))
    assert own.recorded(elsewhere) is None


def test_an_event_without_a_timestamp_is_not_kept() -> None:
    # Decoding gives it the stream's time: the event held here would differ.
    own = OwnAppends()
    own.keep()
    event = _status(timestamp=None)
    _kept(event, own)
    assert len(own) == 0
    assert own.recorded(_record(7, event)) is None


def test_only_the_newest_are_kept() -> None:
    own = OwnAppends()
    own.keep(2)
    events = [_status() for _ in range(3)]
    for event in events:
        _kept(event, own)
    assert len(own) == 2
    assert own.recorded(_record(1, events[0])) is None
    assert [own.recorded(_record(seq, events[seq - 1])) is not None for seq in (2, 3)] == [
        True,
        True,
    ]


def test_nothing_is_kept_until_a_reader_asks() -> None:
    own = OwnAppends()
    _kept(_status(), own)
    assert len(own) == 0
    own.keep()
    _kept(_status(), own)
    assert len(own) == 1

"""The spawner decodes only statuses whose bytes can say `admitted`: it never passes over an
admission, however its JSON is written."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import get_args

import pytest
from hypothesis import given
from hypothesis import strategies as st

from grove_events import StatusEvent, StatusPayload, decode, encode, new_id
from grove_events.kinds import StatusType
from grove_spawner.domain import may_be_admission

pytestmark = pytest.mark.unit

STATUS_TYPES = get_args(StatusType)
NOW = datetime(2026, 1, 1, tzinfo=UTC)


@given(st.sampled_from(STATUS_TYPES), st.text(max_size=40), st.text(max_size=20))
def test_every_admission_may_be_one(status_type: str, summary: str, detail: str) -> None:
    event = StatusEvent(
        event_id=new_id(),
        agent_id="a",
        timestamp=NOW,
        status_type=status_type,  # type: ignore[arg-type]
        payload=StatusPayload(summary=summary, details={"note": detail}),
    )
    data = encode(event)
    decoded = decode("grove.status.a", data)
    assert isinstance(decoded, StatusEvent)
    if decoded.status_type == "admitted":
        assert may_be_admission(data)


def test_an_admission_spelled_with_escapes_may_be_one() -> None:
    event = StatusEvent(event_id=new_id(), agent_id="a", timestamp=NOW, status_type="admitted")
    data = encode(event).replace(b'"admitted"', b'"\\u0061dmitted"')
    assert b"admitted" not in data
    decoded = decode("grove.status.a", data)
    assert isinstance(decoded, StatusEvent)
    assert decoded.status_type == "admitted"
    assert may_be_admission(data)


def test_the_statuses_of_an_ordinary_run_are_not_decoded() -> None:
    for status_type in ("started", "completed", "checkpoint"):
        event = StatusEvent(event_id=new_id(), agent_id="a", timestamp=NOW, status_type=status_type)
        assert not may_be_admission(encode(event))

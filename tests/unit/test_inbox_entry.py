"""What a model reads of its inbox (the `read_inbox` tool): a child's failure says what the
child attempted and had done, so the parent can decide what to do next."""

from __future__ import annotations

from datetime import UTC, datetime

from agentgrove.context import _inbox_entry
from agentgrove.routing import InboxItem
from grove_events import StatusEvent, StatusPayload

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def item(status_type: str, details: dict[str, object]) -> InboxItem:
    event = StatusEvent(
        event_id="e1",
        agent_id="child",
        timestamp=NOW,
        status_type=status_type,  # type: ignore[arg-type]
        payload=StatusPayload(summary="it broke", details=details),
    )
    return InboxItem(index=1, seq=7, event=event, source="child", agent_path=["root", "child"])


def test_a_failure_carries_what_was_attempted_and_done() -> None:
    entry = _inbox_entry(
        item("failed", {"error": "boom", "attempted": ["a"], "partial_results": ["half"]})
    )
    assert entry["status"] == "failed"
    assert entry["text"] == "it broke"
    assert (entry["attempted"], entry["partial_results"]) == (["a"], ["half"])


def test_other_statuses_are_their_summary_only() -> None:
    entry = _inbox_entry(item("checkpoint", {"attempted": ["a"]}))
    assert set(entry) == {"type", "from", "via", "text"}

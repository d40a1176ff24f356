"""The events library: validation, defaults that replay the same, subjects, upcasting."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime

import pytest
from pydantic import ValidationError

from grove_events import (
    EVENT_CLASSES,
    GROVE_STREAM,
    KINDS,
    AgentConfig,
    InvalidEvent,
    MessageEvent,
    SpawnEvent,
    StatusEvent,
    decode,
    encode,
    new_id,
    subject_for,
    upcast,
)
from grove_events.envelope import TOKEN_PATTERN
from grove_events.upcasting import upcast_status_v1_v2

pytestmark = pytest.mark.unit

MINIMAL_SPAWN = {
    "event_id": "e-1",
    "type": "spawn",
    "agent_id": "a-1",
    "task": "count words",
    "config": {"runtime": "command", "command": ["wc", "-w"]},
}


def test_every_kind_has_a_model_and_a_stream_subject() -> None:
    assert set(KINDS) == {
        "spawn",
        "status",
        "fork",
        "terminate",
        "message",
        "control",
        "hitl",
        "artifact",
    }
    for kind in KINDS:
        assert f"grove.{kind}.*" in GROVE_STREAM.subjects
        assert EVENT_CLASSES[kind].model_config["frozen"] is True
        assert EVENT_CLASSES[kind].model_config["extra"] == "forbid"
    assert "grove.deadletter.>" in GROVE_STREAM.subjects
    assert not any(s.startswith("grove.rpc") for s in GROVE_STREAM.subjects)


def test_minimal_spawn_gets_documented_defaults() -> None:
    event = decode("grove.spawn.a-1", json.dumps(MINIMAL_SPAWN).encode())
    assert isinstance(event, SpawnEvent)
    assert event.session_id == "a-1"
    assert event.tree_id == "a-1"  # a root is its own tree
    assert event.parent is None
    assert event.subscribe_parent is True
    assert event.config.return_budget == 6000
    assert event.schema_version == 1


def test_null_session_and_root_tree_take_their_defaults_on_both_decode_paths() -> None:
    stamped = {**MINIMAL_SPAWN, "timestamp": "2026-05-01T12:00:00Z"}
    for body in (MINIMAL_SPAWN, stamped):  # stepwise (no timestamp) and straight from bytes
        nulls = {**body, "session_id": None, "tree_id": None}
        event = decode("grove.spawn.a-1", json.dumps(nulls).encode())
        assert (event.session_id, event.tree_id) == ("a-1", "a-1")
        assert encode(event) == encode(decode("grove.spawn.a-1", json.dumps(body).encode()))
    built = SpawnEvent(event_id="e-1", agent_id="a-3", task="t", config=MINIMAL_SPAWN["config"])
    assert (built.session_id, built.tree_id) == ("a-3", "a-3")


def test_missing_timestamp_is_the_stream_timestamp_every_time() -> None:
    stored_at = datetime(2026, 5, 1, 12, 0, 0, 123000, tzinfo=UTC)
    data = json.dumps(MINIMAL_SPAWN).encode()
    first = decode("grove.spawn.a-1", data, stored_at)
    again = decode("grove.spawn.a-1", data, stored_at)
    assert first.timestamp == again.timestamp == stored_at


def test_child_spawn_leaves_tree_to_the_log() -> None:
    event = decode(
        "grove.spawn.a-2",
        json.dumps({**MINIMAL_SPAWN, "agent_id": "a-2", "parent": "a-1"}).encode(),
    )
    assert isinstance(event, SpawnEvent)
    assert event.tree_id is None


def test_events_are_frozen_and_strict() -> None:
    event = SpawnEvent.model_validate(MINIMAL_SPAWN)
    with pytest.raises(ValidationError):
        event.task = "other"  # type: ignore[misc]
    with pytest.raises(ValidationError, match="Extra inputs"):
        SpawnEvent.model_validate({**MINIMAL_SPAWN, "surprise": 1})


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"runtime": "python"}, "needs config.entrypoint"),
        ({"runtime": "python", "entrypoint": "not a path"}, "needs config.entrypoint"),
        ({"runtime": "command"}, "needs config.command"),
        ({"runtime": "teleport"}, "runtime"),
    ],
)
def test_bad_config_says_what_is_wrong(config: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        AgentConfig.model_validate(config)


def test_agent_ids_must_be_subject_tokens() -> None:
    with pytest.raises(ValidationError, match="should match pattern"):
        SpawnEvent.model_validate({**MINIMAL_SPAWN, "agent_id": "a.b"})
    # The decoder's reason (what a dead letter says) puts the rule in words.
    data = json.dumps({**MINIMAL_SPAWN, "agent_id": "a-1", "parent": "p.q"}).encode()
    with pytest.raises(InvalidEvent, match=r"parent: must be 1-128 .* NATS subject token"):
        decode("grove.spawn.a-1", data)


def test_message_needs_exactly_one_target() -> None:
    base = {"event_id": "e", "agent_id": "a", "from": "a", "content": "hi"}
    with pytest.raises(ValidationError, match="exactly one"):
        MessageEvent.model_validate(base)
    event = MessageEvent.model_validate({**base, "to": "b"})
    assert json.loads(encode(event))["from"] == "a"


def test_decode_rejects_mismatches_with_reasons() -> None:
    data = json.dumps(MINIMAL_SPAWN).encode()
    with pytest.raises(InvalidEvent, match="does not match subject kind"):
        decode("grove.status.a-1", data)
    with pytest.raises(InvalidEvent, match="does not match subject token"):
        decode("grove.spawn.other", data)
    with pytest.raises(InvalidEvent, match="not JSON"):
        decode("grove.spawn.a-1", b"{nope")
    with pytest.raises(InvalidEvent, match="task"):
        decode("grove.spawn.a-1", json.dumps({**MINIMAL_SPAWN, "task": ""}).encode())
    config = MINIMAL_SPAWN["config"]
    for number in ("Infinity", "NaN"):  # not JSON, though Python's json writes them
        endless = {**MINIMAL_SPAWN, "config": {**config, "timeout": float(number.lower())}}
        with pytest.raises(InvalidEvent, match=r"config\.timeout: Input should be a finite"):
            decode("grove.spawn.a-1", json.dumps(endless).encode())


def test_encode_decode_round_trip() -> None:
    event = SpawnEvent.model_validate(MINIMAL_SPAWN)
    assert decode(subject_for("spawn", "a-1"), encode(event)) == event


def test_status_v1_upcaster() -> None:
    v1 = {
        "event_id": "e",
        "type": "status",
        "agent_id": "a",
        "schema_version": 1,
        "status": "checkpoint",
        "summary": "halfway",
    }
    v2 = upcast_status_v1_v2(v1)
    assert v2["status_type"] == "checkpoint"
    assert v2["payload"] == {"summary": "halfway", "details": {}}
    assert v2["schema_version"] == 2
    event = decode("grove.status.a", json.dumps(v1).encode())
    assert isinstance(event, StatusEvent)
    assert event.payload.summary == "halfway"


def test_newer_schema_version_is_refused() -> None:
    with pytest.raises(ValueError, match="newer"):
        upcast({"type": "status", "schema_version": 3})


def test_subject_for_unknown_kind() -> None:
    with pytest.raises(ValueError, match="unknown event kind"):
        subject_for("teleport", "a")


def test_new_ids_are_uuid7s_in_the_order_they_were_made() -> None:
    ids = [new_id() for _ in range(1_000)]
    assert {uuid.UUID(value).version for value in ids} == {7}
    assert ids == sorted(ids)
    assert len(set(ids)) == len(ids)
    assert all(TOKEN_PATTERN.fullmatch(value) for value in ids)  # each can be a subject token

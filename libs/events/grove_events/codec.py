"""Encoding and decoding events: one serialization per event, validation at the edge."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from pydantic import TypeAdapter, ValidationError

from grove_events.envelope import ID_REGEX, ID_RULE
from grove_events.kinds import EVENT_CLASSES, Event
from grove_events.subjects import parse_subject
from grove_events.upcasting import current_version, upcast

EVENT_ADAPTER: TypeAdapter[Event] = TypeAdapter(Event)
_VALIDATORS = {kind: cls.__pydantic_validator__ for kind, cls in EVENT_CLASSES.items()}


class InvalidEvent(ValueError):
    """A message on a `grove.` subject that is not a valid event; it goes to the dead letters."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind
        self.reason = reason


def encode(event: Event) -> bytes:
    """The JSON bytes of an event, with null fields left out (their defaults apply)."""
    return event.__pydantic_serializer__.to_json(event, exclude_none=True, by_alias=True)


def to_dict(event: Event) -> dict[str, Any]:
    """The event as a JSON-ready dict."""
    return event.model_dump(mode="json", exclude_none=True, by_alias=True)


def _short(error: ValidationError) -> str:
    parts = []
    for item in error.errors(include_url=False)[:5]:
        where = ".".join(str(p) for p in item["loc"]) or "event"
        message = item["msg"]
        if item["type"] == "string_pattern_mismatch" and item["ctx"]["pattern"] == ID_REGEX:
            message = ID_RULE
        parts.append(f"{where}: {message}")
    return "; ".join(parts)


def decode(subject: str, data: bytes, stream_timestamp: datetime | None = None) -> Event:
    """Validate a stored message as an event.

    Checks that the subject is an event subject, that its kind and agent match the body, upcasts
    older schema versions, and fills a missing `timestamp` with the stream's own timestamp so
    that every replay decodes the same event.

    Most messages are current, complete events: those are validated straight from their bytes.
    Anything else (invalid, older, without a timestamp) takes the step-by-step path, which
    alone decides what an invalid message's reason is.
    """
    parsed = parse_subject(subject)
    if parsed is None:
        raise InvalidEvent("unknown", f"subject {subject!r} is not grove.<kind>.<agent_id>")
    kind, agent_id = parsed
    try:
        # The subject names the kind: its own model validates (the union would look for it).
        event: Event = _VALIDATORS[kind].validate_json(data)
    except ValidationError:
        return _decode_stepwise(kind, agent_id, data, stream_timestamp)
    if (
        event.type != kind
        or event.agent_id != agent_id
        or event.timestamp is None
        or event.schema_version != current_version(kind)
    ):
        return _decode_stepwise(kind, agent_id, data, stream_timestamp)
    return event


def _decode_stepwise(
    kind: str, agent_id: str, data: bytes, stream_timestamp: datetime | None
) -> Event:
    try:
        raw = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidEvent(kind, f"body is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise InvalidEvent(kind, "body must be a JSON object")
    if raw.get("type") != kind:
        raise InvalidEvent(kind, f"type {raw.get('type')!r} does not match subject kind {kind!r}")
    if raw.get("agent_id") != agent_id:
        raise InvalidEvent(
            kind, f"agent_id {raw.get('agent_id')!r} does not match subject token {agent_id!r}"
        )
    if raw.get("timestamp") is None and stream_timestamp is not None:
        raw["timestamp"] = stream_timestamp.isoformat()
    try:
        return EVENT_ADAPTER.validate_python(upcast(raw))
    except ValidationError as exc:
        raise InvalidEvent(kind, _short(exc)) from None
    except (ValueError, KeyError, TypeError) as exc:
        raise InvalidEvent(kind, str(exc)) from None

"""Fuzzing the edge: whatever arrives on a `grove.` subject is either a valid event or an
InvalidEvent with a reason, never a crash; and the folds survive any valid sequence (duplicated,
out of order, about unknown agents) and replay it to the same rows."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grove_artifacts.domain import ArtifactIndex
from grove_artifacts.domain import evolve as evolve_artifacts
from grove_core.records import Recorded
from grove_core.tree import TreeState
from grove_core.tree import evolve as evolve_tree
from grove_events import KINDS, InvalidEvent, decode, encode, subject_for, to_dict
from grove_events.codec import _decode_stepwise
from grove_governor.domain import GovernorState
from grove_governor.domain import evolve as evolve_governor
from grove_spawner.domain import SpawnerState
from grove_spawner.domain import evolve as evolve_spawner

pytestmark = pytest.mark.unit

#: How many inputs each fuzz test tries (`pytest --hypothesis-show-statistics` shows them).
EXAMPLES = 400
NOW = datetime(2026, 1, 1, tzinfo=UTC)

AGENTS = ["a", "b", "c", "d"]

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=40),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=12,
)

#: Valid bodies of every kind, as a producer might send them.
SAMPLES: dict[str, dict[str, Any]] = {
    "spawn": {"task": "t", "config": {"runtime": "command", "command": ["true"]}},
    "status": {"status_type": "checkpoint", "payload": {"summary": "s"}},
    "fork": {"source_agent": "a", "reason": "r"},
    "terminate": {"reason": "completed", "result": {"summary": "ok"}},
    "message": {"from": "a", "to": "b", "content": "hi"},
    "control": {"action": "stop"},
    "hitl": {"action": "request", "request_id": "r1", "prompt": "why?"},
    "artifact": {"artifact_id": "x1", "name": "n", "size": 1, "sha256": "0" * 64},
}


def body(kind: str, agent: str, event_id: str = "e1", **extra: Any) -> dict[str, Any]:
    """A valid body of `kind` about `agent`."""
    return {"event_id": event_id, "type": kind, "agent_id": agent, **SAMPLES[kind], **extra}


def decode_or_reason(subject: str, data: bytes) -> Any:
    """The event, or the InvalidEvent; anything else raised fails the test."""
    try:
        return decode(subject, data, NOW)
    except InvalidEvent as exc:
        refused = exc
    assert refused.reason, "an invalid message needs a reason"
    assert refused.kind
    return refused


@settings(max_examples=EXAMPLES, suppress_health_check=[HealthCheck.too_slow])
@given(subject=st.text(max_size=40), data=st.binary(max_size=300))
def test_random_bytes_on_random_subjects_never_crash_the_decoder(subject: str, data: bytes) -> None:
    decode_or_reason(subject, data)


@settings(max_examples=EXAMPLES, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(KINDS), value=json_values)
def test_random_json_is_refused_with_a_reason(kind: str, value: Any) -> None:
    result = decode_or_reason(subject_for(kind, "a"), json.dumps(value).encode())
    assert isinstance(result, InvalidEvent)


@settings(max_examples=EXAMPLES, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(KINDS),
    field=st.sampled_from(["event_id", "agent_id", "type", "timestamp", "schema_version", "x"]),
    value=json_values,
)
def test_a_valid_event_with_one_field_damaged_decodes_or_is_refused(
    kind: str, field: str, value: Any
) -> None:
    damaged = {**body(kind, "a"), field: value}
    result = decode_or_reason(subject_for(kind, "a"), json.dumps(damaged).encode())
    if not isinstance(result, InvalidEvent):
        again = decode(subject_for(kind, "a"), encode(result), NOW)
        assert to_dict(again) == to_dict(result)


@settings(max_examples=EXAMPLES, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(KINDS),
    field=st.sampled_from(
        ["event_id", "agent_id", "type", "timestamp", "schema_version", "session_id", "x"]
    ),
    value=json_values | st.sampled_from([1, 2, 3, 2.0, True, "2", "2026-01-01T00:00:00Z"]),
)
def test_the_direct_and_the_stepwise_decoding_agree(kind: str, field: str, value: Any) -> None:
    # Most events are validated straight from their bytes; the step-by-step path is the
    # reference for what is valid, what it decodes to and why it is refused.
    damaged = {**body(kind, "a"), "timestamp": "2026-02-03T04:05:06.789Z", field: value}
    data = json.dumps(damaged).encode()
    direct = decode_or_reason(subject_for(kind, "a"), data)
    try:
        reference: Any = _decode_stepwise(kind, "a", data, NOW)
    except InvalidEvent as exc:
        reference = exc
    if isinstance(reference, InvalidEvent):
        assert isinstance(direct, InvalidEvent)
        assert (direct.kind, direct.reason) == (reference.kind, reference.reason)
    else:
        assert not isinstance(direct, InvalidEvent)
        assert type(direct) is type(reference)
        assert to_dict(direct) == to_dict(reference)


@settings(max_examples=EXAMPLES, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(KINDS), cut=st.integers(0, 400), text=st.text(max_size=2000))
def test_truncated_and_unicode_heavy_bodies(kind: str, cut: int, text: str) -> None:
    field = "task" if kind == "spawn" else "reason" if kind == "fork" else "content"
    full = json.dumps({**body(kind, "a"), field: text}, ensure_ascii=False).encode()
    decode_or_reason(subject_for(kind, "a"), full[:cut])
    result = decode_or_reason(subject_for(kind, "a"), full)
    if not isinstance(result, InvalidEvent):
        assert decode(subject_for(kind, "a"), encode(result), NOW) == result


@settings(max_examples=50)
@given(size=st.integers(100_001, 300_000))
def test_an_oversized_task_is_refused(size: int) -> None:
    data = json.dumps(body("spawn", "a", task="x" * size)).encode()
    result = decode_or_reason(subject_for("spawn", "a"), data)
    assert isinstance(result, InvalidEvent)
    assert "task" in result.reason


def test_a_body_for_another_agent_or_kind_is_refused() -> None:
    wrong_agent = decode_or_reason("grove.spawn.b", json.dumps(body("spawn", "a")).encode())
    wrong_kind = decode_or_reason("grove.status.a", json.dumps(body("spawn", "a")).encode())
    assert isinstance(wrong_agent, InvalidEvent)
    assert "does not match subject token" in wrong_agent.reason
    assert isinstance(wrong_kind, InvalidEvent)
    assert "does not match subject kind" in wrong_kind.reason


# -- the folds under any valid sequence -----------------------------------------------------------

one_event = st.tuples(
    st.sampled_from(["spawn", "status", "fork", "terminate", "control", "artifact"]),
    st.sampled_from(AGENTS),
    st.sampled_from([*AGENTS, None]),
    st.sampled_from(["queued", "admitted", "started", "checkpoint", "rejected", "paused"]),
    st.sampled_from(["stop", "resume", "pause_all", "resume_all"]),
)


def make_event(index: int, spec: tuple[str, str, str | None, str, str]) -> Recorded:
    """A valid event from a compact description; its seq is its place in the sequence."""
    kind, agent, other, status, action = spec
    extra: dict[str, Any] = {}
    if kind == "spawn" and other is not None and other != agent:
        extra["parent"] = other
    if kind == "status":
        extra["status_type"] = status
    if kind == "fork":
        extra["source_agent"] = other or "a"
    if kind == "control":
        extra["action"] = action
    data = body(kind, agent, event_id=f"e{index}", **extra)
    data["timestamp"] = NOW.isoformat()
    event = decode(subject_for(kind, agent), json.dumps(data).encode(), NOW)
    return Recorded(index + 1, subject_for(kind, agent), event)


FOLDS: list[tuple[str, Callable[[], Any], Callable[[Any, Recorded], Any]]] = [
    ("governor", GovernorState, evolve_governor),
    ("spawner", SpawnerState, evolve_spawner),
    ("tree", TreeState, evolve_tree),
    ("artifacts", ArtifactIndex, evolve_artifacts),
]


def fold_rows(
    make: Callable[[], Any], evolve: Callable[[Any, Recorded], Any], log: list[Recorded]
) -> Any:
    state = make()
    for recorded in log:
        state = evolve(state, recorded)
    return json.dumps(
        {k: v for k, v in state.take_dirty().items() if v is not None}, sort_keys=True, default=str
    )


@pytest.mark.parametrize(("name", "make", "evolve"), FOLDS, ids=[f[0] for f in FOLDS])
@settings(max_examples=EXAMPLES // 2, suppress_health_check=[HealthCheck.too_slow])
@given(specs=st.lists(one_event, max_size=30), repeat=st.integers(0, 29))
def test_folds_survive_any_valid_sequence_and_replay_it_the_same(
    name: str,
    make: Callable[[], Any],
    evolve: Callable[[Any, Recorded], Any],
    specs: list[tuple[str, str, str | None, str, str]],
    repeat: int,
) -> None:
    log = [make_event(i, spec) for i, spec in enumerate(specs)]
    if log and repeat < len(log):  # the same event again, later: a duplicate out of order
        again = log[repeat]
        log.append(Recorded(len(log) + 1, again.subject, again.event))
    assert fold_rows(make, evolve, log) == fold_rows(make, evolve, log)

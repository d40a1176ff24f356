"""Appends acknowledged on the connection's own inbox (`grove_core.acks`), against a real
nats-server: each append gets its own answer, however many are in flight; a subject no stream
takes, a refusal and a silence each fail the append that met them, and only it; the inbox works
again after the server restarts."""

from __future__ import annotations

import asyncio

import nats.errors
import nats.js.errors
import pytest
from nats.aio.msg import Msg

from grove_core.acks import AckInbox, Answer, stored
from grove_core.log import Appended, ConcurrencyConflict, EventLog
from grove_events import SpawnEvent, subject_for
from tests.conftest import NatsEndpoint
from tests.integration.test_log import append_after_restart, spawn_event, status_event

pytestmark = pytest.mark.integration


async def assert_stored_as_answered(
    event_log: EventLog, events: list[SpawnEvent], landed: list[Appended], every: int
) -> None:
    """Each of 300 spawns appended to an empty log was answered with its own new sequence,
    in order, and (for every `every`th) is stored there under its event id."""
    assert [a.seq for a in landed] == list(range(1, 301))
    assert not any(a.duplicate for a in landed)
    for event, appended in zip(events[::every], landed[::every], strict=True):
        record = await event_log.get_last(subject_for("spawn", event.agent_id))
        assert record is not None
        assert record.seq == appended.seq
        assert record.headers.get("Nats-Msg-Id") == event.event_id


async def test_pipelined_appends_each_get_their_own_acknowledgement(event_log: EventLog) -> None:
    events = [spawn_event(f"agent-{i}") for i in range(300)]
    landed = await event_log.append_many(events)
    await assert_stored_as_answered(event_log, events, landed, every=50)

    again = await event_log.append_many(events[:3])  # retried: stored once, said so
    assert [(a.seq, a.duplicate) for a in again] == [(1, True), (2, True), (3, True)]


async def test_a_lost_guard_fails_only_its_own_append(event_log: EventLog) -> None:
    await event_log.append(spawn_event("a"))
    first = await event_log.append(status_event("a", "admitted"), expect_last_seq=0)
    racing = [
        event_log.append(status_event("a", "started"), expect_last_seq=first.seq) for _ in range(5)
    ]
    outcomes = await asyncio.gather(*racing, return_exceptions=True)
    won = [o for o in outcomes if not isinstance(o, BaseException)]
    lost = [o for o in outcomes if isinstance(o, BaseException)]
    assert len(won) == 1
    assert len(lost) == 4
    assert all(isinstance(o, ConcurrencyConflict) for o in lost)


async def test_a_subject_no_stream_takes_fails_at_once(event_log: EventLog) -> None:
    with pytest.raises(nats.js.errors.NoStreamResponseError):
        await asyncio.wait_for(event_log.acks.publish("nowhere.at.all", b"{}", {}), 5)


async def test_an_append_nobody_answers_times_out_and_a_late_answer_is_dropped(
    event_log: EventLog,
) -> None:
    """A plain subscriber on the subject takes the message and keeps the answer back: the
    append fails after its timeout; the answer sent later is dropped, and the inbox goes on
    serving other appends."""
    held: list[Msg] = []

    async def hold(msg: Msg) -> None:
        held.append(msg)

    sub = await event_log.nc.subscribe("silent.subject", cb=hold)
    acks = AckInbox(event_log.nc, timeout=0.3)
    try:
        with pytest.raises(nats.errors.TimeoutError):
            await acks.publish("silent.subject", b"{}", {})
        assert len(held) == 1
        assert held[0].reply
        await event_log.nc.publish(held[0].reply, b'{"stream":"GROVE","seq":99}')
        await event_log.nc.flush()
        event = spawn_event("after")
        seq, duplicate = await acks.publish(
            subject_for("spawn", "after"),
            event.model_dump_json(by_alias=True).encode(),
            {"Nats-Msg-Id": event.event_id},
        )
        assert (seq, duplicate) == (1, False)
    finally:
        await sub.unsubscribe()


async def test_a_refusal_is_the_stream_s_own_error() -> None:
    answer = Answer(
        b'{"error":{"code":400,"err_code":10071,"description":"wrong last sequence: 3"}}', None
    )
    with pytest.raises(nats.js.errors.APIError) as refused:
        stored(answer)
    assert (refused.value.err_code, refused.value.description) == (10071, "wrong last sequence: 3")
    assert stored(Answer(b'{"stream":"GROVE","seq":7}', None)) == (7, False)
    with pytest.raises(nats.js.errors.NoStreamResponseError):
        stored(Answer(b"", {"Status": "503"}))


@pytest.mark.local_nats
async def test_appends_go_on_after_the_server_restarts(nats_server: NatsEndpoint) -> None:
    event_log = await EventLog.connect(nats_server.url, name="acks-restart")
    try:
        await event_log.ensure_stream()
        await event_log.append(spawn_event("before"))
        nats_server.kill()
        nats_server.restart()
        appended = await append_after_restart(event_log, spawn_event("after"))
        assert appended.seq == 2
    finally:
        await event_log.close()

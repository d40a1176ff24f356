"""Appends the log does not acknowledge: the SDK and a spawner's `started` send them again for
a while (a cluster electing a stream leader, a server restarting), and the stream keeps one
copy of each."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import nats.errors
import pytest

from agentgrove import GroveClient
from grove_core.log import EventLog, LogError
from grove_core.natsserver import LocalNatsCluster
from grove_core.records import Recorded
from grove_events import GROVE_STREAM, StatusEvent, subject_for
from grove_spawner.service import Spawner
from tests.integration.test_log import spawn_event, status_event
from tests.integration.test_recovery import python_agent, wait_ended
from tests.integration.test_spawner_stops import admit

pytestmark = pytest.mark.integration


class LostAcknowledgements:
    """The log's appends are stored, but the acknowledgements of the next `count` of them
    (of those whose body holds `marker`) are lost on the way back, as when the server that
    took them fails."""

    def __init__(self, log: EventLog, monkeypatch: pytest.MonkeyPatch, marker: bytes = b"") -> None:
        self.count = 0
        self.marker = marker
        self._publish = log.acks.publish
        monkeypatch.setattr(log.acks, "publish", self.publish)

    async def publish(
        self, subject: str, payload: bytes, headers: dict[str, str]
    ) -> tuple[int, bool]:
        answer = await self._publish(subject, payload, headers)
        if self.count and self.marker in payload:
            self.count -= 1
            raise nats.errors.TimeoutError
        return answer


async def test_an_append_whose_acknowledgement_was_lost_is_stored_once_when_sent_again(
    event_log: EventLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    lost = LostAcknowledgements(event_log, monkeypatch)
    agent = "a-" + "1" * 26

    lost.count = 1
    with pytest.raises(LogError, match="no acknowledgement"):
        await event_log.append(spawn_event(agent))  # without patience: the caller hears at once

    # Sent again, the guarded append is answered as the copy its first try stored (a
    # duplicate), not refused because that copy is now the last on its subject (the stream
    # checks the guard before it looks for a copy).
    lost.count = 1
    admitted = await event_log.append(
        status_event(agent, "admitted"), expect_last_seq=0, patience=10
    )
    assert (lost.count, admitted.duplicate) == (0, True)
    info = await event_log.js.stream_info(event_log.stream)
    assert info.state.messages == 2
    last = await event_log.get_last(subject_for("status", agent))
    assert last is not None
    assert last.seq == admitted.seq

    # Patience runs out: the error stands.
    lost.count = 100
    with pytest.raises(LogError, match="no acknowledgement"):
        await event_log.append(status_event(agent, "started"), patience=0.8)
    assert lost.count == 98


async def test_an_append_to_a_log_without_its_stream_fails_at_once_however_patient(
    event_log: EventLog,
) -> None:
    # No stream answers during an election either; but here the server says there is none.
    await event_log.js.delete_stream(event_log.stream)
    async with asyncio.timeout(5):
        with pytest.raises(LogError, match="NoStreamResponseError"):
            await event_log.append(spawn_event("a-" + "3" * 26), patience=30)


async def test_a_message_sent_while_the_stream_leader_is_killed_is_stored_once(
    tmp_path: Path,
) -> None:
    cluster = await asyncio.to_thread(LocalNatsCluster(tmp_path / "cluster").start)
    try:
        log = await EventLog.connect(
            cluster.url, definition=dataclasses.replace(GROVE_STREAM, replicas=3)
        )
        try:
            await log.ensure_stream()
            info = await log.js.stream_info(log.stream)
            assert info.cluster is not None
            leader = cluster.nodes[int(str(info.cluster.leader).rsplit("-", 1)[1])]
            client = GroveClient(log)
            await client.spawn("before", python_agent("quick"))

            await asyncio.to_thread(leader.kill)
            during = await client.spawn("while a leader is elected", python_agent("quick"))

            info = await log.js.stream_info(log.stream)
            assert info.state.messages == 2
            stored = await log.get_last(subject_for("spawn", during))
            assert stored is not None
            assert b"while a leader is elected" in stored.data
        finally:
            await log.close(drain=False)
    finally:
        await asyncio.to_thread(cluster.stop)


async def test_a_started_stored_whose_acknowledgement_was_lost_runs_its_agent(
    spawner: Spawner, event_log: EventLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent_id, admitted = await admit(event_log, python_agent("quick"))
    lost = LostAcknowledgements(event_log, monkeypatch, b'"status_type":"started"')
    lost.count = 1
    assert isinstance(admitted.event, StatusEvent)
    await spawner.start(admitted, admitted.event)
    assert lost.count == 0

    ended = await wait_ended(event_log, [agent_id], timeout=30)
    assert ended[agent_id].reason == "completed"
    kinds = [
        item.event.status_type
        async for item in event_log.events(1, subjects=subject_for("status", agent_id))
        if isinstance(item, Recorded) and isinstance(item.event, StatusEvent)
    ]
    assert kinds.count("started") == 1

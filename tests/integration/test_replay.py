"""Replays against a real nats-server: memory bounded by flow control, and recovery from a lost
or broken consumer without losing or repeating a record."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import nats.errors
import pytest

from grove_core.log import EventLog, LogError
from grove_core.records import RawRecord
from grove_core.replay import OrderedReader
from grove_events import AgentConfig, SpawnEvent, new_id
from tests.conftest import NatsEndpoint

pytestmark = pytest.mark.integration


def spawn_event() -> SpawnEvent:
    return SpawnEvent(
        event_id=new_id(),
        agent_id=new_id(),
        timestamp=datetime.now(UTC),
        task="count to three",
        config=AgentConfig(runtime="command", command=["echo", "hello"]),
    )


async def append(event_log: EventLog, count: int) -> None:
    for start in range(0, count, 1000):
        await event_log.append_many(spawn_event() for _ in range(min(1000, count - start)))


async def append_once(event_log: EventLog, event: SpawnEvent) -> None:
    """Append, retrying while the client reconnects (the event is stored once)."""
    async with asyncio.timeout(30):
        while True:
            try:
                await asyncio.wait_for(event_log.append(event), 2)
            except (LogError, TimeoutError, nats.errors.Error):
                await asyncio.sleep(0.2)
            else:
                return


async def take(reader: OrderedReader, count: int, timeout: float = 20.0) -> list[RawRecord]:
    records = []
    async with asyncio.timeout(timeout):
        while len(records) < count:
            record = await reader.next()
            assert record is not None
            records.append(record)
    return records


async def test_a_slow_reader_holds_only_the_servers_window(event_log: EventLog) -> None:
    # 75 MiB of log, more than twice the most the server keeps in flight (32 MiB) before a
    # flow-control answer.
    total, size = 1_200, 64 * 1024
    acks = [
        await event_log.js.publish_async(f"grove.message.{new_id()}", bytes(size))
        for _ in range(total)
    ]
    await asyncio.gather(*acks)
    reader = OrderedReader(event_log.nc, event_log.js, event_log.stream, ["grove.>"], 1)
    await reader.start()
    seqs = []
    most_buffered = 0
    try:
        async with asyncio.timeout(60):
            while len(seqs) < total:
                record = await reader.next()
                assert record is not None
                seqs.append(record.seq)
                most_buffered = max(most_buffered, reader.buffered)
                if len(seqs) % 20 == 0:
                    await asyncio.sleep(0.01)  # a reader far slower than the server
    finally:
        await reader.close()

    assert seqs == list(range(1, total + 1))
    # The answer to each flow-control request waits until the reader has taken every message
    # before it, so the client holds the server's window, not the log.
    assert most_buffered * size <= 40 * 1024 * 1024, most_buffered


async def test_a_deleted_consumer_is_made_again_from_the_next_record(event_log: EventLog) -> None:
    total = 5_000
    await append(event_log, total)
    reader = OrderedReader(
        event_log.nc, event_log.js, event_log.stream, ["grove.>"], 1, heartbeat=0.5
    )
    await reader.start()
    try:
        first = await take(reader, 100)
        gone = reader.consumer
        assert gone is not None
        await event_log.js.delete_consumer(event_log.stream, gone)
        rest = await take(reader, total - 100)
    finally:
        await reader.close()

    assert [r.seq for r in first + rest] == list(range(1, total + 1))
    assert reader.consumer != gone


async def test_a_foreign_message_on_the_inbox_restarts_after_the_last_record(
    event_log: EventLog,
) -> None:
    total = 3_000
    await append(event_log, total)
    reader = OrderedReader(event_log.nc, event_log.js, event_log.stream, ["grove.>"], 1)
    await reader.start()
    try:
        first = await take(reader, 50)
        inbox, consumer = reader.inbox, reader.consumer
        assert inbox is not None
        # Not a delivery of the consumer (no JetStream reply): the reader cannot tell what it
        # missed, so it makes a new consumer after the last record it holds.
        await event_log.nc.publish(inbox, b"{}")
        rest = await take(reader, total - 50)
        assert await reader.next(timeout=0.5) is None  # the log's end, on the new consumer
    finally:
        await reader.close()

    assert [r.seq for r in first + rest] == list(range(1, total + 1))
    assert reader.consumer != consumer


@pytest.mark.local_nats
async def test_a_follower_goes_on_after_nats_server_restarts(
    nats_server: NatsEndpoint, event_log: EventLog
) -> None:
    await append(event_log, 50)
    reader = OrderedReader(
        event_log.nc, event_log.js, event_log.stream, ["grove.>"], 1, heartbeat=0.5
    )
    await reader.start()
    try:
        before = await take(reader, 50)
        nats_server.kill()
        nats_server.restart()
        for _ in range(50):
            await append_once(event_log, spawn_event())
        after = await take(reader, 50, timeout=30)
    finally:
        await reader.close()

    assert [r.seq for r in before + after] == list(range(1, 101))

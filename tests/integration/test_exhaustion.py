"""Exhaustion: a full log, a database that refuses writes and a NATS server gone for a while
end in clear errors (producers told to retry, services reported not ready), lose nothing, and
the services go on once the resource is back."""

from __future__ import annotations

import asyncio
import dataclasses
import sqlite3
import urllib.error
import urllib.request

import aiohttp
import nats.js.errors
import pytest

from agentgrove.client import GroveClient
from grove_core.log import EventLog, LogError, stream_config
from grove_events import GROVE_STREAM
from tests.conftest import NatsEndpoint, StackFactory
from tests.integration.test_recovery import (
    ROOMY,
    metric_total,
    projection_of,
    python_agent,
    wait_ended,
    wait_status,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

FILLER = b"x" * 1024
#: How long nats-server stays away.
OUTAGE_S = 60


async def set_max_bytes(log: EventLog, max_bytes: int) -> None:
    """Change the GROVE stream's size limit, as an operator would."""
    definition = dataclasses.replace(GROVE_STREAM, max_bytes=max_bytes)
    await log.js.update_stream(stream_config(definition))


async def fill(log: EventLog) -> int:
    """Fill the stream to its limit with filler records, big then small; returns how many fit."""
    count = 0
    for size in (1024, 64, 1):
        while True:
            try:
                await log.js.publish(f"grove.deadletter.filler.{count}", FILLER[:size])
            except nats.js.errors.APIError:
                break
            count += 1
    return count


async def test_a_full_log_refuses_appends_with_a_clear_error_and_loses_nothing(
    make_stack: StackFactory, event_log: EventLog
) -> None:
    stack = await asyncio.to_thread(make_stack, config=ROOMY)
    client = GroveClient(event_log)
    running = await client.spawn("3", python_agent("sleeper"))  # it ends while the log is full
    await wait_status(event_log, "started", [running], timeout=30)
    await asyncio.to_thread(stack.services["governor"].stop)
    before_full = await client.spawn("spawned before the log filled up", python_agent("quick"))
    used = (await event_log.js.stream_info(event_log.stream)).state.bytes
    await set_max_bytes(event_log, used + 64 * 1024)
    assert await fill(event_log) > 10

    with pytest.raises(LogError, match="the log is full") as refused:
        await client.spawn("refused while full", python_agent("quick"))
    assert "retry" in str(refused.value)
    await asyncio.to_thread(stack.services["governor"].start)
    await asyncio.sleep(4)  # the governor tries to admit, the sleeper to end, into a full log
    assert stack.services["governor"].alive, "the governor gave up on a full log"

    await set_max_bytes(event_log, -1)
    after = await client.spawn("spawned after space came back", python_agent("quick"))

    ended = await wait_ended(event_log, [running, before_full, after], timeout=60)
    assert {a: e.reason for a, e in ended.items()} == {
        running: "completed",
        before_full: "completed",
        after: "completed",
    }


@pytest.mark.local_nats
async def test_services_wait_out_a_nats_outage_and_go_on(
    nats_server: NatsEndpoint, make_stack: StackFactory
) -> None:
    stack = await asyncio.to_thread(make_stack, config=ROOMY)
    await asyncio.to_thread(nats_server.kill)
    await asyncio.sleep(OUTAGE_S)
    assert all(service.alive for service in stack.services.values())
    await asyncio.to_thread(nats_server.restart)

    log = await EventLog.connect(nats_server.url, name="after-outage")
    try:
        client = GroveClient(log)
        agent = await client.spawn("after the outage", python_agent("quick"))
        ended = await wait_ended(log, [agent], timeout=60)
    finally:
        await log.close()
    assert ended[agent].reason == "completed"
    await asyncio.to_thread(stack.wait_ready, 30.0)


def readyz(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code


async def wait_readyz(port: int, status: int, timeout: float = 30) -> None:
    async with asyncio.timeout(timeout):
        while True:
            if await asyncio.to_thread(readyz, port) == status:
                return
            await asyncio.sleep(0.2)


async def test_a_database_that_refuses_writes_makes_the_service_unready_and_loses_nothing(
    make_stack: StackFactory, event_log: EventLog
) -> None:
    stack = await asyncio.to_thread(make_stack, config=ROOMY)
    client = GroveClient(event_log)
    router = stack.services["router"]
    before = await client.spawn("before the lock", python_agent("quick"))
    await wait_ended(event_log, [before], timeout=30)

    # Another writer holds the router's database: every write of its projection now fails.
    lock = sqlite3.connect(stack.data_dir / "router.db", isolation_level=None, timeout=1)
    lock.execute("BEGIN EXCLUSIVE")
    try:
        during = await client.spawn("while the database is locked", python_agent("quick"))
        await wait_ended(event_log, [during], timeout=30)
        await wait_readyz(router.http_port, 503)
        async with aiohttp.ClientSession() as session:
            errors = await metric_total(
                session,
                router.http_port,
                "grove_projection_write_errors_total",
                projection="router",
            )
        assert errors >= 1
        # The fold goes on in memory: the router still answers, up to date.
        summary = await client.routing.summary(during)
        assert summary["state"] == "completed"
        assert projection_of(stack.data_dir, "governor")[0] > 0, "only the router is locked out"
    finally:
        lock.execute("ROLLBACK")
        lock.close()

    await wait_readyz(router.http_port, 200)
    tip = await event_log.last_seq()
    async with asyncio.timeout(20):
        while True:
            if projection_of(stack.data_dir, "router")[0] >= tip:
                break
            await asyncio.sleep(0.2)
    # What was folded while the database was locked is on disk: a restart starts from it.
    await asyncio.to_thread(router.kill)
    await asyncio.to_thread(stack.restart, "router")
    assert (await client.routing.summary(during))["state"] == "completed"
    assert (await client.routing.summary(before))["state"] == "completed"

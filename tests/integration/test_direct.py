"""Direct subscriptions of the event log's connection (`grove_core.connection`), against a real
nats-server: each message reaches the function in the order sent, headers and all; a function
that raises is reported and the messages after it still come; nothing comes after the
subscription ends; a plain nats-py client gets the same through a callback."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

import nats
import pytest

from grove_core.connection import GroveConnection, LazyHeaders, subscribe_direct
from grove_core.log import EventLog
from tests.conftest import NatsEndpoint

pytestmark = pytest.mark.integration

Message = tuple[str, str, bytes, Mapping[str, str] | None]


def collector(into: list[Message], until: int, done: asyncio.Event) -> Callable[..., None]:
    def handle(subject: str, reply: str, data: bytes, headers: Mapping[str, str] | None) -> None:
        into.append((subject, reply, data, headers))
        if len(into) >= until:
            done.set()

    return handle


async def test_messages_reach_the_function_in_order_with_their_headers(
    event_log: EventLog,
) -> None:
    nc = event_log.nc
    assert isinstance(nc, GroveConnection)
    got: list[Message] = []
    done = asyncio.Event()
    inbox = nc.new_inbox()
    sub = await subscribe_direct(nc, f"{inbox}.*", collector(got, 502, done))
    for i in range(500):
        await nc.publish(f"{inbox}.{i}", str(i).encode(), reply=f"r.{i}")
    await nc.publish(f"{inbox}.h", b"x", headers={"Nats-Msg-Id": "m-1", "Other": "two words"})
    await nc.publish(f"{inbox}.empty", b"", headers={"Status": "100"})
    await asyncio.wait_for(done.wait(), 5)
    assert [data for _, _, data, _ in got[:500]] == [str(i).encode() for i in range(500)]
    assert got[7] == (f"{inbox}.7", "r.7", b"7", None)
    assert got[500] == (f"{inbox}.h", "", b"x", {"Nats-Msg-Id": "m-1", "Other": "two words"})
    assert isinstance(got[500][3], LazyHeaders)  # a body's headers: parsed when read
    assert got[501][2:] == (b"", {"Status": "100"})
    assert isinstance(got[501][3], dict)  # a status: parsed at once
    await sub.unsubscribe()


async def test_a_function_that_raises_is_reported_and_the_next_messages_come(
    nats_server: NatsEndpoint,
) -> None:
    errors: list[Exception] = []

    async def error_cb(exc: Exception) -> None:
        errors.append(exc)

    log = await EventLog.connect(nats_server.url, name="test-raises", error_cb=error_cb)
    nc = log.nc
    got: list[bytes] = []
    done = asyncio.Event()

    def handle(subject: str, reply: str, data: bytes, headers: Mapping[str, str] | None) -> None:
        if data == b"bad":
            raise ValueError("cannot take this one")
        got.append(data)
        if data == b"last":
            done.set()

    try:
        inbox = nc.new_inbox()
        await subscribe_direct(nc, inbox, handle)
        for data in (b"first", b"bad", b"last"):
            await nc.publish(inbox, data)
        await asyncio.wait_for(done.wait(), 5)
        assert got == [b"first", b"last"]
        assert [str(e) for e in errors] == ["cannot take this one"]
        assert nc.is_connected
    finally:
        await log.close()


async def test_nothing_comes_after_the_subscription_ends(event_log: EventLog) -> None:
    nc = event_log.nc
    assert isinstance(nc, GroveConnection)
    got: list[Message] = []
    done = asyncio.Event()
    inbox = nc.new_inbox()
    sub = await subscribe_direct(nc, inbox, collector(got, 1, done))
    await nc.publish(inbox, b"one")
    await asyncio.wait_for(done.wait(), 5)
    await sub.unsubscribe()
    assert sub._id not in nc._direct
    await nc.publish(inbox, b"two")
    await nc.flush()
    await asyncio.sleep(0.1)
    assert [data for _, _, data, _ in got] == [b"one"]


async def test_a_plain_client_gets_the_same_through_a_callback(
    nats_server: NatsEndpoint,
) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        got: list[Message] = []
        done = asyncio.Event()
        inbox = nc.new_inbox()
        await subscribe_direct(nc, inbox, collector(got, 2, done))
        await nc.publish(inbox, b"a", reply="r")
        await nc.publish(inbox, b"b", headers={"K": "v"})
        await asyncio.wait_for(done.wait(), 5)
        assert got == [(inbox, "r", b"a", None), (inbox, "", b"b", {"K": "v"})]
    finally:
        await nc.close()

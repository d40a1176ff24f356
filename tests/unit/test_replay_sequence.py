"""The replay reader's reading of what arrives: records in consumer order, and every sign
that something was missed (a gap, a heartbeat ahead of it, an unknown status)."""

from __future__ import annotations

from typing import Any

from grove_core.replay import OrderedReader

NOW_NS = 1_700_000_000_000_000_000


def reader() -> OrderedReader:
    return OrderedReader(None, None, "GROVE", ["grove.>"], 1)  # type: ignore[arg-type]


#: What a reader's subscription hands over: subject, reply subject, body, headers.
Message = tuple[str, str, bytes, dict[str, str] | None]


def delivery(stream_seq: int, consumer_seq: int) -> Message:
    reply = f"$JS.ACK.GROVE.c.1.{stream_seq}.{consumer_seq}.{NOW_NS}.0"
    return ("grove.spawn.a", reply, b"{}", None)


def control(reply: str = "", **headers: Any) -> Message:
    return ("_INBOX.x", reply, b"", {"Status": "100", **headers})


def test_deliveries_in_consumer_order_are_kept() -> None:
    r = reader()
    for consumer_seq, stream_seq in enumerate([3, 7, 8], start=1):
        r._arrived(*delivery(stream_seq, consumer_seq))
    assert not r._lost
    assert [record.seq for record in r._records] == [3, 7, 8]
    assert r._last_seq == 8


def test_a_skipped_delivery_marks_the_consumer_lost_and_keeps_what_came_before() -> None:
    r = reader()
    r._arrived(*delivery(1, 1))
    r._arrived(*delivery(3, 3))
    assert r._lost
    assert [record.seq for record in r._records] == [1]
    assert r._last_seq == 1  # the next consumer starts at 2


def test_a_heartbeat_naming_a_delivery_never_seen_marks_the_consumer_lost() -> None:
    r = reader()
    r._arrived(*delivery(1, 1))
    r._arrived(*control(**{"Nats-Last-Consumer": "1"}))
    assert not r._lost
    r._arrived(*control(**{"Nats-Last-Consumer": "2"}))
    assert r._lost


def test_an_unknown_status_marks_the_consumer_lost() -> None:
    r = reader()
    r._arrived("_INBOX.x", "", b"", {"Status": "409"})
    assert r._lost


def test_flow_control_is_owed_once_the_messages_before_it_are_taken() -> None:
    r = reader()
    r._arrived(*delivery(1, 1))
    r._arrived(*delivery(2, 2))
    r._arrived(*control(reply="$JS.FC.GROVE.x.1"))
    r._arrived(*delivery(3, 3))
    # a stalled server repeats its request in a heartbeat
    r._arrived(*control(**{"Nats-Consumer-Stalled": "$JS.FC.GROVE.x.1"}))
    assert list(r._flow) == [(2, "$JS.FC.GROVE.x.1"), (3, "$JS.FC.GROVE.x.1")]
    assert r._ready()  # records to take
    r._records.clear()
    r._taken = 1
    assert not r._ready()  # the request waits for the second record to be taken
    r._taken = 2
    assert r._ready()


async def test_records_held_from_the_consumer_before_do_not_count_for_the_next() -> None:
    r = reader()
    r._arrived(*delivery(1, 1))
    r._arrived(*delivery(2, 2))
    r._arrived(*delivery(4, 4))  # a gap: the consumer is made again after seq 2
    assert r._lost
    r._begin_consumer()  # what making the new consumer does to the bookkeeping
    r._arrived(*delivery(3, 1))
    r._arrived(*control(reply="$JS.FC.GROVE.y.1"))
    assert [record.seq for record in r._records] == [1, 2, 3]
    r._records.popleft()
    r._taken += 1
    r._records.popleft()
    r._taken += 1
    assert r._flow[0][0] > r._taken  # the request waits for seq 3, not for 1 and 2
    r._records.popleft()
    r._taken += 1
    assert r._flow[0][0] <= r._taken

"""Reading a delivery's place in the stream from its reply subject, as replays do."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

import pytest
from nats.aio.msg import Msg
from nats.js.api import Base

from grove_core.records import delivery_position, stream_time

# A stream time whose nanoseconds a float rounds up into the next millisecond.
NANOSECONDS = 1_612_798_959_299_999_769


@pytest.mark.parametrize(
    "reply",
    [
        f"$JS.ACK.GROVE.replay.1.4711.12.{NANOSECONDS}.93",
        f"$JS.ACK._.ACCHASH.GROVE.replay.1.4711.12.{NANOSECONDS}.93.token",
        f"$JS.ACK.hub.ACCHASH.GROVE.replay.2.4711.12.{NANOSECONDS}.93",
    ],
)
def test_both_reply_forms_give_the_sequences_pending_and_time(reply: str) -> None:
    meta = Msg(_client=None, subject="grove.spawn.a", reply=reply).metadata  # type: ignore[arg-type]
    position = delivery_position(reply)
    assert position is not None
    seq, consumer_seq, pending, timestamp = position
    assert (seq, consumer_seq, pending) == (
        meta.sequence.stream,
        meta.sequence.consumer,
        meta.num_pending,
    )
    assert (seq, consumer_seq, pending) == (4711, 12, 93)
    assert timestamp == datetime(2021, 2, 8, 15, 42, 39, 299000, tzinfo=UTC)


def test_the_time_is_the_one_a_direct_get_of_the_same_message_reads() -> None:
    # A direct get carries the time as text with nanoseconds; both paths must agree, or a
    # replay could decode an event without its own timestamp differently from a lookup.
    header = "2021-02-08T15:42:39.299999769Z"
    position = delivery_position(f"$JS.ACK.GROVE.replay.1.1.1.{NANOSECONDS}.0")
    assert position is not None
    assert position[3] == stream_time(Base._parse_utc_iso(header))


def test_every_millisecond_is_read_exactly() -> None:
    # The time is made from a float of seconds; it must be the whole millisecond the server
    # sent, not a microsecond off, at any moment from 1970 to 2100.
    epoch = datetime(1970, 1, 1, tzinfo=UTC)
    moments = random.Random(7).sample(range(4_102_444_800_000), 50_000)
    for ms in [0, 1, 999, 1_612_798_959_299, *moments]:
        position = delivery_position(f"$JS.ACK.GROVE.replay.1.1.1.{ms * 1_000_000 + 999_999}.0")
        assert position is not None
        assert position[3] == epoch + timedelta(milliseconds=ms), ms


@pytest.mark.parametrize(
    "reply",
    ["_INBOX.abc", "$JS.ACK.GROVE.replay.1.x.12.1.0", "$JS.NAK.GROVE.replay.1.1.1.1.0", ""],
)
def test_other_subjects_are_not_read_as_positions(reply: str) -> None:
    assert delivery_position(reply) is None

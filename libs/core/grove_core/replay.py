"""Replaying the log: an ordered push consumer whose flow control follows its reader.

A replay reads the GROVE stream in order from any sequence, through an ephemeral push consumer
with flow control and heartbeats, as NATS' ordered consumers do. This reader differs from
nats-py's in one point that matters for a long replay: the server pauses at each flow-control
request until the client answers, and nats-py answers as soon as the messages before the
request reach the client when a callback takes them. A reader slower than the server then ends
up holding most of the log in memory. Here a request is answered only once the caller has taken
every message sent before it, so the server never runs more than its window ahead.

The rest follows the ordered-consumer design (NATS ADR-17): a gap in the consumer sequence, a
heartbeat that names a delivery never seen, a status the reader does not know, or heartbeats
that stop, and the consumer is made again from the sequence after the last message received.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from typing import TypeVar

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js import api as js_api

from grove_core.connection import subscribe_direct
from grove_core.records import RawRecord, delivery_position

log = logging.getLogger(__name__)

#: Seconds between the server's heartbeats on an idle consumer.
HEARTBEAT_S = 5.0
#: Heartbeats missed in a row after which the consumer is taken for lost and made again.
MISSED_HEARTBEATS = 2
#: How long making the first consumer keeps asking while JetStream elects the stream's leader.
UNAVAILABLE_RETRY_S = 30.0
#: Pause between attempts to make the consumer again after it was lost.
RETRY_PAUSE_S = 0.5

T = TypeVar("T")


async def while_electing(
    attempt: Callable[[], Awaitable[T]], within: float = UNAVAILABLE_RETRY_S
) -> T:
    """Run `attempt`, again every `RETRY_PAUSE_S` while JetStream answers that it is
    unavailable or does not answer (a stream leader being elected, in a new or failing-over
    cluster), for at most `within` seconds; then its error stands."""
    deadline = asyncio.get_running_loop().time() + within
    while True:
        try:
            return await attempt()
        except (nats.js.errors.ServiceUnavailableError, nats.errors.TimeoutError):
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(RETRY_PAUSE_S)


_STATUS = "Status"
_CONTROL = "100"  # flow-control requests and heartbeats
_STALLED = "Nats-Consumer-Stalled"
_LAST_CONSUMER = "Nats-Last-Consumer"


class OrderedReader:
    """Reads `filters` of `stream` in stream order from `from_seq`, one record at a time.

    `start` makes the consumer; `next` gives each record; `close` drops the subscription (the
    server removes the ephemeral consumer once nobody listens).
    """

    def __init__(
        self,
        nc: NatsClient,
        js: JetStreamContext,
        stream: str,
        filters: list[str],
        from_seq: int,
        *,
        heartbeat: float = HEARTBEAT_S,
    ) -> None:
        self.nc = nc
        self.js = js
        self.stream = stream
        self.filters = filters
        self.heartbeat = heartbeat
        #: The server's name of the current consumer, and the subject it delivers to.
        self.consumer: str | None = None
        self.inbox: str | None = None
        #: Records received and not yet taken, in stream order.
        self._records: deque[RawRecord] = deque()
        #: The stream sequence of the newest record received (the next consumer starts after).
        self._last_seq = max(from_seq, 1) - 1
        #: Records received from the current consumer, and taken by the caller, in all.
        self._received = 0
        self._taken = 0
        #: Flow-control replies owed: (records received when asked, reply subject).
        self._flow: deque[tuple[int, str]] = deque()
        self._next_consumer_seq = 1
        #: Whether anything arrived since the reader last looked (the liveness check).
        self._active = True
        self._heard_at = 0.0
        #: Set when the consumer must be made again (a gap, a lost consumer).
        self._lost = False
        self._generation = 0
        self._sub: Subscription | None = None
        self._arrival: asyncio.Future[None] | None = None

    async def start(self) -> None:
        """Make the consumer, asking again while JetStream is electing the stream's leader."""
        try:
            await while_electing(self._subscribe)
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        """Stop listening; the server removes the consumer on its own."""
        self._generation += 1
        sub, self._sub = self._sub, None
        if sub is not None:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    @property
    def buffered(self) -> int:
        """Records received and not yet taken."""
        return len(self._records)

    async def next(self, timeout: float | None = None) -> RawRecord | None:
        """The next record; None when nothing arrived for `timeout` seconds (None: wait on).

        Calling `next` again tells the reader that the record it gave before is done with, which
        is what lets the server send more.
        """
        while True:
            if self._flow and self._flow[0][0] <= self._taken:
                await self._answer_flow()
            if self._records:
                self._taken += 1
                return self._records.popleft()
            if self._lost:
                await self._resubscribe()
                continue
            if not await self._wait(timeout):
                return None

    async def _subscribe(self) -> None:
        """Listen on a new inbox and make a consumer delivering to it, after `_last_seq`."""
        await self.close()
        generation = self._begin_consumer()

        def arrived(
            subject: str, reply: str, data: bytes, headers: Mapping[str, str] | None
        ) -> None:
            if generation == self._generation:
                self._arrived(subject, reply, data, headers)

        inbox = self.inbox = self.nc.new_inbox()
        self._sub = await subscribe_direct(self.nc, inbox, arrived)
        single = len(self.filters) == 1
        config = js_api.ConsumerConfig(
            deliver_subject=inbox,
            deliver_policy=js_api.DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=self._last_seq + 1,
            ack_policy=js_api.AckPolicy.NONE,
            max_deliver=1,
            flow_control=True,
            idle_heartbeat=self.heartbeat,
            mem_storage=True,
            num_replicas=1,
            filter_subject=self.filters[0] if single else None,
            filter_subjects=None if single else self.filters,
        )
        info = await self.js.add_consumer(self.stream, config)
        self.consumer = info.name

    def _begin_consumer(self) -> int:
        """Start the bookkeeping of a new consumer; its generation (older ones' messages are
        ignored)."""
        self._generation += 1
        self._received = 0
        # Records of the consumer before, still held, are taken before any of this one's:
        # they do not count towards this one's flow-control answers.
        self._taken = -len(self._records)
        self._flow.clear()
        self._next_consumer_seq = 1
        self._lost = False
        self._active = True
        self._heard_at = asyncio.get_running_loop().time()
        return self._generation

    async def _resubscribe(self) -> None:
        """Make the consumer again after a loss, for as long as it takes."""
        while True:
            log.info(
                "replay of %s: making the consumer again after seq %s", self.stream, self._last_seq
            )
            try:
                await self._subscribe()
            except (nats.errors.Error, TimeoutError) as exc:
                log.warning("replay of %s: cannot make the consumer yet (%s)", self.stream, exc)
                await asyncio.sleep(RETRY_PAUSE_S)
            else:
                return

    def _arrived(
        self, subject: str, reply: str, data: bytes, headers: Mapping[str, str] | None
    ) -> None:
        """One message from the current consumer: a record, or a control message."""
        self._active = True
        if not data and headers and _STATUS in headers:
            self._control(reply, headers)
        else:
            position = delivery_position(reply)
            if position is None or position[1] != self._next_consumer_seq:
                self._lost = True  # not a delivery of this consumer, or one was missed
            else:
                seq, consumer_seq, pending, timestamp = position
                self._next_consumer_seq = consumer_seq + 1
                self._last_seq = seq
                self._received += 1
                self._records.append(RawRecord(seq, subject, data, timestamp, headers, pending))
        arrival = self._arrival
        if arrival is not None and not arrival.done():
            arrival.set_result(None)

    def _control(self, reply: str, headers: Mapping[str, str]) -> None:
        if headers[_STATUS] != _CONTROL:
            self._lost = True  # e.g. 409 "consumer deleted"
        elif reply:
            self._flow.append((self._received, reply))  # a flow-control request
        else:  # a heartbeat
            stalled = headers.get(_STALLED)
            if stalled:  # the server still waits for this answer
                self._flow.append((self._received, stalled))
            last = headers.get(_LAST_CONSUMER)
            if last is not None and int(last) >= self._next_consumer_seq:
                self._lost = True  # the server delivered messages that never arrived

    async def _answer_flow(self) -> None:
        """Answer the flow-control requests whose messages have all been taken."""
        while self._flow and self._flow[0][0] <= self._taken:
            _, reply = self._flow.popleft()
            with contextlib.suppress(nats.errors.Error):
                await self.nc.publish(reply)

    def _ready(self) -> bool:
        return bool(self._records or self._lost or (self._flow and self._flow[0][0] <= self._taken))

    async def _wait(self, timeout: float | None) -> bool:
        """Wait until there is something to do; False after `timeout` seconds of nothing.

        Marks the consumer lost when neither a message nor a heartbeat came for
        `MISSED_HEARTBEATS` heartbeats.
        """
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while not self._ready():
            now = loop.time()
            if self._active:
                self._active = False
                self._heard_at = now
            elif now - self._heard_at > MISSED_HEARTBEATS * self.heartbeat:
                self._lost = True
                return True
            if deadline is not None and now >= deadline:
                return False
            wait = self.heartbeat if deadline is None else min(self.heartbeat, deadline - now)
            self._arrival = loop.create_future()
            try:
                async with asyncio.timeout(wait):
                    await self._arrival
            except TimeoutError:
                pass
            finally:
                self._arrival = None
        return True

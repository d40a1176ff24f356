"""Appends to a JetStream stream, acknowledged on one inbox of the connection.

nats-py's `JetStreamContext.publish` is a request: a token made with `os.urandom`, a future with
a callback that forgets it, `asyncio.wait_for` around it, and the stream's answer parsed by
`json` into a `PubAck` dataclass. Against a local server that is about 110 µs of client CPU per
awaited append, and a spawner makes three appends for every agent it runs. `AckInbox` sends the
same message with a reply subject on its own wildcard inbox (a counter for tokens, one timer
per append, the answer read by orjson): about 87 µs. On the log's own connection the message
goes out by `GroveConnection.publish_headed`, its header block encoded at once. The stream, its
deduplication and its guards see exactly the same message.

With `batch_from` (the services' `GROVE_APPEND_BATCH_FROM`), appends sent while many are
unanswered go out as atomic batches: nats-server 2.12.1 and later store a batch at once, with one
sync to disk where the server syncs every write. A raw client on the development machine, with
`sync_interval: always`, stored about 5,000 single messages a second, and 13,000 in batches of
50. A batch has its own fixed cost, though. For a single replica on file storage, the server
stages each batch in a file store of its own, about 1.5 ms of its CPU. With the default sync,
batches of 20 were slower than single messages, and the services' burst lost a third
(`bench/README.md`, item 68).

Failures are nats-py's own exceptions, so that callers map them as they did: the stream's
refusal is `nats.js.errors.APIError` (from its error object), no stream on the subject is
`nats.js.errors.NoStreamResponseError`, no answer in time is `nats.errors.TimeoutError`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
from collections.abc import Mapping
from typing import NamedTuple

import nats.errors
import nats.js.errors
import orjson
from nats.aio.client import Client as NatsClient

from grove_core.connection import GroveConnection, header_block, subscribe_direct
from grove_core.metrics import APPEND_BATCHES

log = logging.getLogger(__name__)

#: Headers of an atomic batch (nats-server 2.12.1 and later; the stream needs `allow_atomic`).
BATCH_ID = "Nats-Batch-Id"
BATCH_SEQUENCE = "Nats-Batch-Sequence"
BATCH_COMMIT = "Nats-Batch-Commit"
#: The stream's refusals of every batch: it does not allow atomic publishing, or the server
#: takes no batch holding a header the appends carry (nats-server 2.12.0 took no
#: `Nats-Msg-Id`); the appends then go alone from the first refusal on.
ATOMIC_PUBLISH_DISABLED = 10174
ATOMIC_PUBLISH_UNSUPPORTED_HEADER = 10177


class Answer(NamedTuple):
    """The stream's answer to an append: its body, and its headers (a failure's status)."""

    data: bytes
    headers: Mapping[str, str] | None


class _Queued(NamedTuple):
    """A message waiting for the next batch, and the future of its own answer."""

    subject: str
    payload: bytes
    headers: dict[str, str]
    timeout: float
    future: asyncio.Future[Answer]


class AckInbox:
    """Sends messages to a stream and hands back the stream's acknowledgement of each.

    With `batch_from`, a message sent while that many are unanswered waits for the end of the
    event loop's turn and goes out with the others queued in that turn as one atomic batch
    (`Nats-Batch-Id`), which the stream stores, and syncs to disk, at once. Each message is
    answered as if it had been sent alone. A batch the stream refuses (one lost guard, one copy
    already stored) is sent again message by message, so that each gets its own answer.
    """

    def __init__(
        self, nc: NatsClient, timeout: float, *, batch_from: int = 0, batch_max: int = 256
    ) -> None:
        self.nc = nc
        #: Seconds an append waits for its acknowledgement, unless told otherwise.
        self.timeout = timeout
        #: With this many messages unanswered, the next ones go out in atomic batches (0: never).
        self.batch_from = batch_from
        #: The most messages in one batch (nats-server's own limit is 1,000).
        self.batch_max = batch_max
        self._prefix: str | None = None
        self._subscribing = asyncio.Lock()
        self._tokens = itertools.count()
        #: token -> (the future of the answer, the timer that fails it)
        self._waiting: dict[str, tuple[asyncio.Future[Answer], asyncio.TimerHandle]] = {}
        #: Messages sent and not answered yet, alone or in batches.
        self._unanswered = 0
        self._queued: list[_Queued] = []
        #: Batch ids: random for this inbox, then a counter (nats-server takes up to 64
        #: characters).
        self._batch_prefix = f"{secrets.token_hex(12)}-"
        self._batch_ids = itertools.count()
        self._batching: asyncio.Task[None] | None = None
        self._resending: set[asyncio.Task[None]] = set()
        #: Batches the stream stored, and batches it refused (their messages then went alone).
        self.batches = 0
        self.refused_batches = 0

    async def _inbox(self) -> str:
        """The inbox prefix answers come to, subscribed on first use (nats-py subscribes again
        after a reconnect)."""
        if self._prefix is None:
            async with self._subscribing:
                if self._prefix is None:
                    inbox = self.nc.new_inbox()
                    await subscribe_direct(self.nc, f"{inbox}.*", self._answered)
                    self._prefix = f"{inbox}."
        return self._prefix

    def _answered(
        self, subject: str, _reply: str, data: bytes, headers: Mapping[str, str] | None
    ) -> None:
        prefix = self._prefix or ""
        entry = self._waiting.pop(subject[len(prefix) :], None)
        if entry is None:  # timed out, or a duplicate answer
            return
        future, timer = entry
        timer.cancel()
        if not future.done():
            future.set_result(Answer(data, headers))

    def _expire(self, token: str) -> None:
        entry = self._waiting.pop(token, None)
        if entry is not None and not entry[0].done():
            entry[0].set_exception(nats.errors.TimeoutError())

    async def send(
        self,
        subject: str,
        payload: bytes,
        headers: dict[str, str],
        timeout: float | None = None,
    ) -> asyncio.Future[Answer]:
        """Publish a message for the stream; the future of the stream's answer (see
        `stored`), failed with `nats.errors.TimeoutError` when none came in time."""
        timeout = self.timeout if timeout is None else timeout
        if self._batching is not None or (self.batch_from and self._unanswered >= self.batch_from):
            return self._queue(subject, payload, headers, timeout)
        future = await self._send_alone(subject, payload, headers, timeout)
        self._unanswered += 1
        future.add_done_callback(self._answered_one)
        return future

    def _answered_one(self, _future: asyncio.Future[Answer]) -> None:
        self._unanswered -= 1

    async def _send_alone(
        self, subject: str, payload: bytes, headers: dict[str, str], timeout: float
    ) -> asyncio.Future[Answer]:
        prefix = await self._inbox()
        token = str(next(self._tokens))
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Answer] = loop.create_future()
        timer = loop.call_later(timeout, self._expire, token)
        self._waiting[token] = (future, timer)
        try:
            await self._publish(subject, prefix + token, headers, payload)
        except BaseException:
            self._waiting.pop(token, None)
            timer.cancel()
            raise
        return future

    async def _publish(
        self, subject: str, reply: str, headers: dict[str, str], payload: bytes
    ) -> None:
        if isinstance(self.nc, GroveConnection):
            await self.nc.publish_headed(subject, reply, header_block(headers), payload)
        else:
            await self.nc.publish(subject, payload, reply=reply, headers=headers)

    # -- batches -----------------------------------------------------------------------

    def _queue(
        self, subject: str, payload: bytes, headers: dict[str, str], timeout: float
    ) -> asyncio.Future[Answer]:
        future: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self._queued.append(_Queued(subject, payload, headers, timeout, future))
        self._unanswered += 1
        future.add_done_callback(self._answered_one)
        if self._batching is None:
            self._batching = asyncio.ensure_future(self._send_batches())
        return future

    async def _send_batches(self) -> None:
        """Send what is queued, a batch at a time, until nothing is (later sends queue behind,
        so that messages go out in the order they were sent). When one cannot be sent (the
        connection closed), it and everything queued behind it fail with that error."""
        failure: BaseException = nats.errors.ConnectionClosedError()
        try:
            await asyncio.sleep(0)  # the rest of this turn's sends join the batch
            while self._queued:
                batch = self._queued[: self.batch_max]
                del self._queued[: self.batch_max]
                try:
                    await self._send_batch(batch)
                except asyncio.CancelledError:
                    for item in batch:
                        item.future.cancel()
                    raise
                except (nats.errors.Error, OSError, ValueError) as exc:
                    failure = exc
                    for item in batch:
                        _fail(item.future, exc)
                    break
        finally:
            self._batching = None
            for item in self._queued:  # left only when sending failed or was cancelled
                _fail(item.future, failure)
            self._queued.clear()

    async def _send_batch(self, batch: list[_Queued]) -> None:
        if self.batch_from and not server_takes_batches(self.nc):
            log.warning(
                "nats-server %r takes no atomic batches of appends (2.12.1 and later do); "
                "appends go alone",
                self.nc.connected_server_version,
            )
            self.batch_from = 0
        if len(batch) == 1 or not self.batch_from:
            await self._send_each(batch)
            return
        batch_id = f"{self._batch_prefix}{next(self._batch_ids)}"
        last = len(batch)
        for number, item in enumerate(batch, 1):
            headers = {**item.headers, BATCH_ID: batch_id, BATCH_SEQUENCE: str(number)}
            if number < last:
                await self._publish(item.subject, "", headers, item.payload)
        headers[BATCH_COMMIT] = "1"
        commit = await self._send_alone(
            batch[-1].subject, batch[-1].payload, headers, max(item.timeout for item in batch)
        )
        commit.add_done_callback(lambda done: self._batch_answered(batch, done))

    def _follow(self, item: _Queued, future: asyncio.Future[Answer]) -> None:
        """Answer a queued message with the answer it gets alone."""

        def copy(done: asyncio.Future[Answer]) -> None:
            if done.cancelled():
                item.future.cancel()
            elif (exc := done.exception()) is not None:
                _fail(item.future, exc)
            elif not item.future.done():
                item.future.set_result(done.result())

        future.add_done_callback(copy)

    def _batch_answered(self, batch: list[_Queued], done: asyncio.Future[Answer]) -> None:
        """Answer each message of a batch from the stream's answer to its commit."""
        exc = nats.errors.TimeoutError() if done.cancelled() else done.exception()
        if exc is not None:
            # No answer in time: the batch may or may not be stored, as for one append.
            for item in batch:
                _fail(item.future, exc)
            return
        answer = done.result()
        body = orjson.loads(answer.data) if answer.data else {}
        error = body.get("error")
        if error is None and body.get("count") == len(batch):
            first = int(body["seq"]) - len(batch) + 1
            stream = body.get("stream", "")
            self.batches += 1
            APPEND_BATCHES.labels("stored").inc()
            for offset, item in enumerate(batch):
                if not item.future.done():
                    item.future.set_result(
                        Answer(orjson.dumps({"stream": stream, "seq": first + offset}), None)
                    )
            return
        if error is not None and error.get("err_code") in (
            ATOMIC_PUBLISH_DISABLED,
            ATOMIC_PUBLISH_UNSUPPORTED_HEADER,
        ):
            log.warning("the stream takes no batches of appends (%s); appends go alone", error)
            self.batch_from = 0
        # One message kept the whole batch out (a lost guard, a copy stored before), and the
        # stream stored none of them: each is sent again alone, to get its own answer.
        self.refused_batches += 1
        APPEND_BATCHES.labels("refused").inc()
        task = asyncio.ensure_future(self._send_each(batch))
        self._resending.add(task)
        task.add_done_callback(self._resending.discard)

    async def _send_each(self, batch: list[_Queued]) -> None:
        """Send each message alone; one that cannot be sent fails, and the next are tried."""
        for index, item in enumerate(batch):
            try:
                self._follow(item, await self._send_alone(*item[:4]))
            except (nats.errors.Error, OSError, ValueError) as exc:  # it could not be sent
                _fail(item.future, exc)
            except asyncio.CancelledError:
                for rest in batch[index:]:
                    rest.future.cancel()
                raise

    async def publish(
        self, subject: str, payload: bytes, headers: dict[str, str]
    ) -> tuple[int, bool]:
        """Publish and wait for the stream's acknowledgement: its sequence and whether it was
        a duplicate (see `stored` for the failures)."""
        return stored(await (await self.send(subject, payload, headers)))


def _fail(future: asyncio.Future[Answer], exc: BaseException) -> None:
    if future.done():
        return
    if isinstance(exc, asyncio.CancelledError):
        future.cancel()
    else:
        future.set_exception(exc)


def server_takes_batches(nc: NatsClient) -> bool:
    """Whether the connected nats-server takes atomic batches of appends: 2.12.1 and later (2.12.0
    refused a batch holding `Nats-Msg-Id`, which every append carries); a version that does
    not parse does not."""
    version = nc.connected_server_version
    try:
        return (version.major, version.minor, version.patch) >= (2, 12, 1)
    except ValueError:
        return False


def stored(answer: Answer) -> tuple[int, bool]:
    """The stream sequence of an acknowledged message, and whether the stream had it already.

    Raises `nats.js.errors.APIError` when the stream refused it, and
    `nats.js.errors.NoStreamResponseError` when no stream takes its subject.
    """
    if not answer.data:
        headers = answer.headers or {}
        status = headers.get("Status")
        if status == "503":
            raise nats.js.errors.NoStreamResponseError
        raise nats.js.errors.APIError(
            code=int(status) if status and status.isdigit() else None,
            description=headers.get("Description") or "an empty answer",
        )
    body = orjson.loads(answer.data)
    error = body.get("error")
    if error is not None:
        raise nats.js.errors.APIError.from_error(error)
    return int(body["seq"]), bool(body.get("duplicate", False))

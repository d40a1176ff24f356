"""Appends to a JetStream stream, acknowledged on one inbox of the connection.

nats-py's `JetStreamContext.publish` is a request: a token made with `os.urandom`, a future with
a callback that forgets it, `asyncio.wait_for` around it, and the stream's answer parsed by
`json` into a `PubAck` dataclass. Against a local server that is about 110 µs of client CPU per
awaited append, and a spawner makes three appends for every agent it runs. `AckInbox` sends the
same message with a reply subject on its own wildcard inbox (a counter for tokens, one timer
per append, the answer read by orjson): about 87 µs. On the log's own connection the message
goes out by `GroveConnection.publish_headed`, its header block encoded at once. The stream, its
deduplication and its guards see exactly the same message.

Failures are nats-py's own exceptions, so that callers map them as they did: the stream's
refusal is `nats.js.errors.APIError` (from its error object), no stream on the subject is
`nats.js.errors.NoStreamResponseError`, no answer in time is `nats.errors.TimeoutError`.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Mapping
from typing import NamedTuple

import nats.errors
import nats.js.errors
import orjson
from nats.aio.client import Client as NatsClient

from grove_core.connection import GroveConnection, header_block, subscribe_direct


class Answer(NamedTuple):
    """The stream's answer to an append: its body, and its headers (a failure's status)."""

    data: bytes
    headers: Mapping[str, str] | None


class AckInbox:
    """Sends messages to a stream and hands back the stream's acknowledgement of each."""

    def __init__(self, nc: NatsClient, timeout: float) -> None:
        self.nc = nc
        #: Seconds an append waits for its acknowledgement, unless told otherwise.
        self.timeout = timeout
        self._prefix: str | None = None
        self._subscribing = asyncio.Lock()
        self._tokens = itertools.count()
        #: token -> (the future of the answer, the timer that fails it)
        self._waiting: dict[str, tuple[asyncio.Future[Answer], asyncio.TimerHandle]] = {}

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
        prefix = await self._inbox()
        token = str(next(self._tokens))
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Answer] = loop.create_future()
        timer = loop.call_later(self.timeout if timeout is None else timeout, self._expire, token)
        self._waiting[token] = (future, timer)
        try:
            if isinstance(self.nc, GroveConnection):
                await self.nc.publish_headed(
                    subject, prefix + token, header_block(headers), payload
                )
            else:
                await self.nc.publish(subject, payload, reply=prefix + token, headers=headers)
        except BaseException:
            self._waiting.pop(token, None)
            timer.cancel()
            raise
        return future

    async def publish(
        self, subject: str, payload: bytes, headers: dict[str, str]
    ) -> tuple[int, bool]:
        """Publish and wait for the stream's acknowledgement: its sequence and whether it was
        a duplicate (see `stored` for the failures)."""
        return stored(await (await self.send(subject, payload, headers)))


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

"""Newest-message lookups, asked for together: one direct get for many subjects.

A lookup costs the client about 90 µs of CPU, nearly all of it the request's round trip rather
than the answer, and a spawner makes several for every agent it starts, many at the same
moment. `LastLookups` gathers the lookups asked for in one turn of the event loop and sends
them as a single direct get with `multi_last` (NATS ADR-31, nats-server 2.11 and later): the
server answers with the newest message of each subject that has one, then an end-of-batch
status. A lookup alone, or of a subject with wildcards (where `multi_last` would answer one
message per matching subject), goes out on its own as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from grove_core.records import RawRecord, stream_time

#: The JetStream API's subject prefix (no domain).
JS_API = "$JS.API"
#: Seconds a lookup waits for its answer, as the other JetStream requests.
LOOKUP_TIMEOUT_S = 10.0
#: The most subjects one request names (a larger gathering is split).
MAX_SUBJECTS = 256

_END_OF_BATCH = "204"
_NO_RESULTS = "404"

Lookup = Callable[[str], Awaitable[RawRecord | None]]


def record_of_direct_get(msg: Msg) -> RawRecord | None:
    """The message a direct get's reply carries; None for "no message" (404).

    Raises nats.js.errors.APIError for any other status the server answered.
    """
    headers = msg.headers or {}
    status = headers.get("Status")
    if status and not msg.data:
        if status == _NO_RESULTS:
            return None
        nats.js.errors.APIError.from_msg(msg)  # raises: what the server answered
    return RawRecord(
        seq=int(headers["Nats-Sequence"]),
        subject=headers["Nats-Subject"],
        data=msg.data,
        timestamp=stream_time(datetime.fromisoformat(headers["Nats-Time-Stamp"])),
        headers=headers,
    )


def is_literal(subject: str) -> bool:
    """Whether a subject names one subject (no `*` or `>` token)."""
    return not any(token in ("*", ">") for token in subject.split("."))


@dataclass
class _Batch:
    """One multi-subject request under way: what came back so far, and its end."""

    done: asyncio.Future[None]
    records: dict[str, RawRecord] = field(default_factory=dict)


class LastLookups:
    """Gathers `get` calls made in one turn of the event loop into one direct get.

    `single` is the lookup of one subject (used for a gathering of one, for wildcards, and
    when the server refuses a batch).
    """

    def __init__(self, nc: NatsClient, stream: str, single: Lookup) -> None:
        self.nc = nc
        self.stream = stream
        self.single = single
        #: Requests sent, and subjects they named (for tests and the curious).
        self.requests = 0
        self.subjects = 0
        self._waiting: dict[str, list[asyncio.Future[RawRecord | None]]] = {}
        self._flush_scheduled = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._inbox: str | None = None
        self._sub: Subscription | None = None
        self._batches: dict[str, _Batch] = {}
        self._next_token = 0

    async def get(self, subject: str) -> RawRecord | None:
        """The newest message on a literal subject, or None."""
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[RawRecord | None] = loop.create_future()
        self._waiting.setdefault(subject, []).append(answer)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            loop.call_soon(self._flush)
        return await answer

    async def close(self) -> None:
        """Stop listening for batch answers (lookups under way fail)."""
        sub, self._sub = self._sub, None
        if sub is not None:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    def _flush(self) -> None:
        self._flush_scheduled = False
        waiting, self._waiting = self._waiting, {}
        subjects = list(waiting)
        for start in range(0, len(subjects), MAX_SUBJECTS):
            group = {
                subject: waiting[subject] for subject in subjects[start : start + MAX_SUBJECTS]
            }
            if len(group) == 1:
                ((subject, answers),) = group.items()
                work = self._one(subject, answers)
            else:
                work = self._many(group)
            task = asyncio.create_task(work)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _one(self, subject: str, answers: list[asyncio.Future[RawRecord | None]]) -> None:
        try:
            record = await self.single(subject)
        except BaseException as exc:
            _fail(answers, exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
        else:
            _answer(answers, record)

    async def _many(self, group: dict[str, list[asyncio.Future[RawRecord | None]]]) -> None:
        try:
            batch = await self._ask(list(group))
        except nats.js.errors.APIError:
            # A server without `multi_last` (before 2.11), or one that refuses this batch:
            # each subject on its own, which reports its own failure.
            for subject, answers in group.items():
                await self._one(subject, answers)
            return
        except BaseException as exc:
            for answers in group.values():
                _fail(answers, exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        for subject, answers in group.items():
            _answer(answers, batch.records.get(subject))

    async def _ask(self, subjects: list[str]) -> _Batch:
        """Send one `multi_last` request and wait for its end of batch."""
        inbox = await self._listening()
        token = str(self._next_token)
        self._next_token += 1
        batch = _Batch(asyncio.get_running_loop().create_future())
        self._batches[token] = batch
        try:
            request = json.dumps({"multi_last": subjects}).encode()
            await self.nc.publish(
                f"{JS_API}.DIRECT.GET.{self.stream}", request, reply=f"{inbox}.{token}"
            )
            self.requests += 1
            self.subjects += len(subjects)
            try:
                await asyncio.wait_for(asyncio.shield(batch.done), LOOKUP_TIMEOUT_S)
            except TimeoutError:
                raise nats.errors.TimeoutError from None  # as a single lookup's timeout
        finally:
            del self._batches[token]
        return batch

    async def _listening(self) -> str:
        if self._sub is None or self._inbox is None:
            self._inbox = self.nc.new_inbox()
            self._sub = await self.nc.subscribe(f"{self._inbox}.*", cb=self._arrived)
        return self._inbox

    async def _arrived(self, msg: Msg) -> None:
        batch = self._batches.get(msg.subject.rpartition(".")[2])
        if batch is None or batch.done.done():
            return  # a batch that timed out meanwhile
        headers = msg.headers or {}
        status = headers.get("Status")
        if status and not msg.data:
            if status in (_END_OF_BATCH, _NO_RESULTS):
                batch.done.set_result(None)
            else:
                try:
                    nats.js.errors.APIError.from_msg(msg)
                except nats.js.errors.APIError as exc:
                    batch.done.set_exception(exc)
            return
        record = record_of_direct_get(msg)
        if record is not None:
            batch.records[record.subject] = record


def _answer(answers: list[asyncio.Future[RawRecord | None]], record: RawRecord | None) -> None:
    for answer in answers:
        if not answer.done():
            answer.set_result(record)


def _fail(answers: list[asyncio.Future[RawRecord | None]], exc: BaseException) -> None:
    for answer in answers:
        if not answer.done():
            answer.set_exception(exc)

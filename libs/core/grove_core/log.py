"""The event log: the GROVE JetStream stream, appended to and read back.

Appends are idempotent (`Nats-Msg-Id = event_id`) and may be guarded by an expected per-subject
sequence, so that where exactly one decision may win, the loser learns it lost. Reading is a
replay with an ordered consumer (fast, from any sequence, following the log once at its tip),
or a lookup of one message (the newest on a subject, the next from a sequence, the one at a
sequence).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from nats.js import api as js_api

from grove_core.acks import AckInbox, Answer, stored
from grove_core.connection import GroveConnection
from grove_core.records import (
    OwnAppends,
    RawRecord,
    Recorded,
    decode_record,
    is_deadletter,
    stream_time,
)
from grove_core.replay import RETRY_PAUSE_S, OrderedReader, while_electing
from grove_events import (
    GROVE_STREAM,
    Event,
    InvalidEvent,
    StreamDefinition,
    deadletter_subject,
    encode,
    subject_for,
)

if TYPE_CHECKING:
    from grove_core.catchup import CatchUpHelper

log = logging.getLogger(__name__)

#: The JetStream API's subject prefix (no domain).
JS_API = "$JS.API"
#: Seconds a lookup (a direct get) waits for its answer, as the other JetStream requests.
LOOKUP_TIMEOUT_S = 10.0
#: Seconds an append waits for the stream's acknowledgement.
APPEND_TIMEOUT_S = 10.0
#: How long the SDK's appends (agents, callers) are sent again while the log does not
#: acknowledge them: a cluster electing a stream's leader, a server restarting. The services
#: retry their own appends their own way.
APPEND_PATIENCE_S = 30.0
#: How long a patient append that no stream answered waits to hear whether the stream exists.
STREAM_CHECK_TIMEOUT_S = 1.0
#: Appends of `append_many` unacknowledged at once, at most.
APPEND_WINDOW = 2000
#: JetStream's error code for "wrong last sequence": someone else wrote first.
WRONG_LAST_SEQUENCE = 10071
EXPECTED_SUBJECT_HEADER = "Nats-Expected-Last-Subject-Sequence-Subject"


class LogError(RuntimeError):
    """The log could not be reached or refused an operation; the message says what to do."""


class LogFull(LogError):
    """The stream is at its size limit and refuses new messages; nothing was stored."""

    def __init__(self, subject: str, description: str) -> None:
        super().__init__(
            f"the log is full ({description}); {subject} was not stored: retry once an operator "
            "has freed space or raised the GROVE stream's limits"
        )


#: JetStream's error code for a stream at its limits ("maximum bytes/messages exceeded").
LOG_FULL_CODES = frozenset({10077})


def refused(subject: str, code: int | None, description: str | None) -> LogError:
    """The domain error for an append the stream refused."""
    if code in LOG_FULL_CODES:
        return LogFull(subject, description or "stream limit reached")
    return LogError(f"the log refused {subject}: {description}")


class ConcurrencyConflict(LogError):
    """An append guarded by an expected sequence lost: someone else decided first."""

    def __init__(self, subject: str, expected: int) -> None:
        super().__init__(f"{subject}: the last sequence is no longer {expected}")
        self.subject = subject
        self.expected = expected


@dataclass(frozen=True, slots=True)
class Appended:
    """Where an append landed; `duplicate` when the same event_id was already stored."""

    seq: int
    duplicate: bool


@dataclass(frozen=True, slots=True)
class Append:
    """One append of a batch: an event and its optional guard, as for `EventLog.append`."""

    event: Event
    expect_last_seq: int | None = None
    expect_subject: str | None = None


def stream_config(definition: StreamDefinition = GROVE_STREAM) -> js_api.StreamConfig:
    """The JetStream configuration of the GROVE stream."""
    return js_api.StreamConfig(
        name=definition.name,
        subjects=list(definition.subjects),
        storage=js_api.StorageType(definition.storage),
        duplicate_window=definition.duplicate_window_s,
        max_bytes=definition.max_bytes,
        max_msgs=definition.max_msgs,
        discard=js_api.DiscardPolicy(definition.discard),
        max_consumers=definition.max_consumers,
        num_replicas=definition.replicas,
        allow_direct=True,
        allow_atomic=True,
    )


def _record_of_stored(raw: js_api.RawStreamMsg) -> RawRecord:
    """A message nats-py's `get_msg` or `get_last_msg` read from the stream, as a record."""
    return RawRecord(
        seq=int(raw.seq or 0),
        subject=str(raw.subject),
        data=raw.data or b"",
        timestamp=stream_time(raw.time or datetime.now(UTC)),
        headers=dict(raw.headers or {}),
    )


async def _any_reachable(servers: list[str], within: float) -> bool:
    """Whether any server accepts a TCP connection before `within` seconds have passed."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    targets = []
    for server in servers:
        parsed = urlsplit(server if "://" in server else f"nats://{server}")
        targets.append((parsed.hostname or "127.0.0.1", parsed.port or 4222))
    while True:
        for host, port in targets:
            try:
                _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 2.0)
            except (OSError, TimeoutError):
                continue
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
            return True
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(0.2)


class EventLog:
    """Appends to and reads from the GROVE stream over one NATS connection."""

    def __init__(
        self, nc: NatsClient, js: JetStreamContext, definition: StreamDefinition = GROVE_STREAM
    ) -> None:
        self.nc = nc
        self.js = js
        #: Appends go out on the connection and are acknowledged on one inbox (`AckInbox`).
        self.acks = AckInbox(nc, APPEND_TIMEOUT_S)
        self.definition = definition
        self.stream = definition.name
        #: Whether lookups may be answered by any replica (see `_direct`); None: not known yet.
        self._direct_reads: bool | None = None
        #: How a projection far behind may read its catch-up in a helper process (None: it
        #: reads everything itself); a service sets it from its settings.
        self.helper: CatchUpHelper | None = None
        #: The events appended here lately, which this service's projection folds without
        #: decoding them again (`OwnAppends`).
        self.own = OwnAppends()

    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        name: str = "agentgrove",
        definition: StreamDefinition = GROVE_STREAM,
        connect_timeout: float = 5.0,
        reachable_within: float = 30.0,
        **options: Any,
    ) -> EventLog:
        """Connect to NATS; raises LogError with the URL when nothing answers there.

        The first connection waits at most `reachable_within` seconds for a server to accept
        TCP connections; once connected, the client reconnects forever (unless told otherwise).
        """
        servers = [u.strip() for u in url.split(",") if u.strip()]
        if not await _any_reachable(servers, reachable_within):
            raise LogError(
                f"cannot reach NATS at {url} (nothing accepts connections there); start the "
                "stack with `grove up` or set GROVE_NATS_URL"
            )
        try:
            nc = GroveConnection()
            # nats-py types the timeout as int; it is used as seconds, fractions included.
            options["connect_timeout"] = connect_timeout
            await nc.connect(
                servers,
                name=name,
                allow_reconnect=options.pop("allow_reconnect", True),
                max_reconnect_attempts=options.pop("max_reconnect_attempts", -1),
                **options,
            )
        except (OSError, nats.errors.Error, TimeoutError) as exc:
            detail = str(exc) or exc.__class__.__name__
            raise LogError(
                f"cannot connect to NATS at {url}: {detail} (check the URL and credentials)"
            ) from None
        return cls(nc, nc.jetstream(timeout=10.0), definition)

    async def close(self, *, drain: bool = True) -> None:
        """Flush pending publishes and close the connection.

        `drain=False` closes at once, for a reader that publishes nothing: a drain waits for the
        server's answer, and when cancelled it still waits for it (up to nats-py's flush
        timeout, 10 s), even once the connection's read loop is gone.
        """
        with contextlib.suppress(Exception):
            if drain:
                await self.nc.drain()
            else:
                await self.nc.close()

    async def ensure_stream(self) -> js_api.StreamInfo:
        """Create the stream, or update it to the definition (used by set-up, not by services).

        Asked again while JetStream does not answer (a new cluster forming the stream's raft
        group, or electing a leader): a create that was stored but not answered is answered
        the second time with the same stream, as creating an identical stream is no change.
        """
        config = stream_config(self.definition)

        async def create_or_update() -> js_api.StreamInfo:
            try:
                return await self.js.add_stream(config)
            except nats.js.errors.BadRequestError:
                return await self.js.update_stream(config)

        return await while_electing(create_or_update)

    async def wait_for_stream(self, timeout: float = 30.0) -> js_api.StreamInfo:
        """Bind to the stream, waiting for set-up to create it; services never redefine it."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            try:
                return await self.js.stream_info(self.stream)
            except (nats.js.errors.NotFoundError, nats.errors.TimeoutError):
                if asyncio.get_running_loop().time() > deadline:
                    raise LogError(
                        f"stream {self.stream} does not exist; run `grove up` or the "
                        "stream set-up job first"
                    ) from None
                await asyncio.sleep(0.2)

    async def _stream_info(self) -> js_api.StreamInfo:
        """The stream's info, asked again while its leader is being elected (a node of a
        cluster failing over does not answer for a few seconds; see `while_electing`)."""
        return await while_electing(lambda: self.js.stream_info(self.stream))

    async def last_seq(self) -> int:
        """The sequence of the newest message in the stream (0 when empty)."""
        info = await self._stream_info()
        return int(info.state.last_seq)

    async def identity(self) -> tuple[str, int]:
        """Which log this is, and the sequence of its newest message.

        The identity is the stream's name and the time the server made it: a stream deleted
        and made again under the same name (its sequences start again at 1) has another one,
        while a restart of the server keeps it.
        """
        info = await self._stream_info()
        made = info.created.isoformat() if info.created is not None else "unknown"
        return f"{self.stream} made {made}", int(info.state.last_seq)

    # -- appending -----------------------------------------------------------------------

    @staticmethod
    def _headers(
        event: Event, expect_last_seq: int | None, expect_subject: str | None
    ) -> dict[str, str]:
        headers = {js_api.Header.MSG_ID.value: event.event_id}
        if expect_last_seq is not None:
            headers[js_api.Header.EXPECTED_LAST_SUBJECT_SEQUENCE.value] = str(expect_last_seq)
            if expect_subject is not None:
                headers[EXPECTED_SUBJECT_HEADER] = expect_subject
        return headers

    def _encoded(self, event: Event) -> bytes:
        """The body of an append; kept with its event for this connection's projection."""
        data = encode(event)
        self.own.remember(data, event)
        return data

    async def append(
        self,
        event: Event,
        *,
        expect_last_seq: int | None = None,
        expect_subject: str | None = None,
        patience: float = 0.0,
    ) -> Appended:
        """Append one event; a retry with the same event_id is stored once.

        With `expect_last_seq`, the append succeeds only if the last message on the event's
        subject (or on `expect_subject`, which may hold wildcards) has that sequence (0: none);
        otherwise ConcurrencyConflict is raised.

        An append the log does not acknowledge raises LogError. With `patience` (seconds), it
        is first sent again, every `RETRY_PAUSE_S`, until that much time has passed since the
        first try: the stream keeps one copy (`duplicate` says a try before was stored). The
        stream checks a guard before it looks for a copy, so a guarded append sent again finds
        its own earlier try in the way; it is answered as that copy, not as a conflict.
        """
        subject = subject_for(event.type, event.agent_id)
        headers = self._headers(event, expect_last_seq, expect_subject)
        data = self._encoded(event)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + patience
        sent_before = False
        while True:
            try:
                seq, duplicate = await self.acks.publish(subject, data, headers)
            except nats.js.errors.APIError as exc:
                if exc.err_code != WRONG_LAST_SEQUENCE:
                    raise refused(subject, exc.err_code, exc.description) from None
                guard = expect_subject or subject
                if sent_before and expect_last_seq is not None:
                    earlier = await self.get_next(guard, expect_last_seq + 1)
                    if earlier is not None and earlier.data == data:
                        return Appended(earlier.seq, True)
                raise ConcurrencyConflict(guard, expect_last_seq or 0) from None
            except (nats.errors.TimeoutError, nats.js.errors.NoStreamResponseError) as exc:
                if (
                    loop.time() + RETRY_PAUSE_S > deadline
                    or (not sent_before
                        and isinstance(exc, nats.js.errors.NoStreamResponseError)
                        and await self._stream_missing())
                ):  # fmt: skip
                    raise self._unacknowledged(subject, exc) from None
                if not sent_before:
                    log.warning(
                        "no acknowledgement for %s (%s); sending it again for up to %g s",
                        subject,
                        exc.__class__.__name__,
                        patience,
                    )
                sent_before = True
                await asyncio.sleep(RETRY_PAUSE_S)
                continue
            return Appended(seq, duplicate)

    async def _stream_missing(self) -> bool:
        """Whether the server says at once that the stream does not exist. No stream answers
        an append while a cluster elects the stream's leader either; then the server does not
        say so, or does not answer in time."""
        try:
            await asyncio.wait_for(self.js.stream_info(self.stream), STREAM_CHECK_TIMEOUT_S)
        except nats.js.errors.NotFoundError:
            return True
        except (nats.errors.Error, TimeoutError):
            return False
        return False

    def _unacknowledged(self, subject: str, exc: BaseException) -> LogError:
        return LogError(
            f"no acknowledgement from stream {self.stream} for {subject} "
            f"({exc.__class__.__name__}); retry: the append is idempotent"
        )

    async def append_many(self, events: Iterable[Event]) -> list[Appended]:
        """Append many events pipelined (at most `APPEND_WINDOW` unacknowledged at once), in
        order; each stored once."""
        out: list[Appended] = []
        window: list[tuple[str, asyncio.Future[Answer]]] = []
        for event in events:
            subject = subject_for(event.type, event.agent_id)
            headers = self._headers(event, None, None)
            window.append((subject, await self.acks.send(subject, self._encoded(event), headers)))
            if len(window) >= APPEND_WINDOW:
                out.extend(await self._acknowledged(window))
                window = []
        out.extend(await self._acknowledged(window))
        return out

    async def _acknowledged(self, sent: list[tuple[str, asyncio.Future[Answer]]]) -> list[Appended]:
        """Where each unguarded append landed (LogError when any was refused or not
        acknowledged: a retry of them all is idempotent)."""
        answers = await asyncio.gather(*(future for _, future in sent), return_exceptions=True)
        out = []
        for (subject, _), answer in zip(sent, answers, strict=True):
            try:
                if isinstance(answer, BaseException):
                    raise answer
                out.append(Appended(*stored(answer)))
            except nats.js.errors.APIError as exc:
                raise refused(subject, exc.err_code, exc.description) from None
            except (nats.errors.TimeoutError, nats.js.errors.NoStreamResponseError) as exc:
                raise self._unacknowledged(subject, exc) from None
        return out

    async def append_batch(
        self, appends: Sequence[Append], *, timeout: float = 10.0
    ) -> list[Appended | ConcurrencyConflict]:
        """Append many events pipelined, each with its own guard, in order.

        Returns, for each, where it landed or the ConcurrencyConflict of a guard that lost; the
        appends that lost change nothing, the others are stored. Raises LogError when the log
        refused or did not acknowledge an append within `timeout` seconds (a retry of the
        batch is idempotent).
        """
        futures = []
        for item in appends:
            event = item.event
            headers = self._headers(event, item.expect_last_seq, item.expect_subject)
            subject = subject_for(event.type, event.agent_id)
            futures.append(await self.acks.send(subject, self._encoded(event), headers, timeout))
        answers = await asyncio.gather(*futures, return_exceptions=True)
        out: list[Appended | ConcurrencyConflict] = []
        for item, answer in zip(appends, answers, strict=True):
            subject = subject_for(item.event.type, item.event.agent_id)
            try:
                if isinstance(answer, BaseException):
                    raise answer
                out.append(Appended(*stored(answer)))
            except nats.js.errors.APIError as exc:
                if exc.err_code != WRONG_LAST_SEQUENCE:
                    raise refused(subject, exc.err_code, exc.description) from None
                out.append(
                    ConcurrencyConflict(item.expect_subject or subject, item.expect_last_seq or 0)
                )
            except (nats.errors.TimeoutError, nats.js.errors.NoStreamResponseError) as exc:
                raise self._unacknowledged(subject, exc) from None
        return out

    async def record_invalid(self, record: RawRecord, error: InvalidEvent, service: str) -> bool:
        """Record an invalid message on `grove.deadletter.<kind>.<seq>`, once whoever asks.

        Returns True when this call recorded it, False when it was already recorded.
        """
        subject = deadletter_subject(error.kind, record.seq)
        body = {
            "source_seq": record.seq,
            "subject": record.subject,
            "error": error.reason,
            "recorded_by": service,
            "data": record.data[:65536].decode("utf-8", errors="replace"),
        }
        headers = {
            js_api.Header.MSG_ID.value: f"deadletter-{record.seq}",
            js_api.Header.EXPECTED_LAST_SUBJECT_SEQUENCE.value: "0",
        }
        try:
            _, duplicate = await self.acks.publish(subject, json.dumps(body).encode(), headers)
        except nats.js.errors.APIError as exc:
            if exc.err_code == WRONG_LAST_SEQUENCE:
                return False
            raise
        return not duplicate

    # -- reading ---------------------------------------------------------------------------

    async def _direct(self) -> bool:
        """Whether lookups are direct gets. Any replica of a stream answers a direct get, and
        a follower may not have the newest messages yet: a spawner that looked up an admitted
        agent's spawn there could find nothing and drop the admission. So a replicated
        stream's lookups go to its leader (asked again while a leader is elected); a
        single-replica stream's are direct (faster)."""
        if self._direct_reads is None:
            try:
                info = await self.js.stream_info(self.stream)
            except (nats.js.errors.NotFoundError, nats.errors.TimeoutError):
                return False  # the leader answers until the stream is known
            self._direct_reads = (info.config.num_replicas or 1) <= 1
        return self._direct_reads

    async def get_last(self, subject: str) -> RawRecord | None:
        """The newest message on a subject (wildcards allowed), or None."""
        if await self._direct():
            return await self._direct_get(f"{JS_API}.DIRECT.GET.{self.stream}.{subject}", b"")
        try:
            raw = await while_electing(lambda: self.js.get_last_msg(self.stream, subject))
        except nats.js.errors.NotFoundError:
            return None
        return _record_of_stored(raw)

    async def get_next(self, subject: str, from_seq: int) -> RawRecord | None:
        """The first message on a subject (wildcards allowed) at or after `from_seq`, or None."""
        if await self._direct():
            request = json.dumps({"seq": max(from_seq, 1), "next_by_subj": subject}).encode()
            return await self._direct_get(f"{JS_API}.DIRECT.GET.{self.stream}", request)
        try:
            raw = await while_electing(
                lambda: self.js.get_msg(
                    self.stream, seq=max(from_seq, 1), subject=subject, next=True
                )
            )
        except nats.js.errors.NotFoundError:
            return None
        return _record_of_stored(raw)

    async def get_at(self, seq: int) -> RawRecord | None:
        """The message at stream sequence `seq`, or None (never stored, or removed since)."""
        if await self._direct():
            request = json.dumps({"seq": seq}).encode()
            return await self._direct_get(f"{JS_API}.DIRECT.GET.{self.stream}", request)
        try:
            raw = await while_electing(lambda: self.js.get_msg(self.stream, seq=seq))
        except nats.js.errors.NotFoundError:
            return None
        return _record_of_stored(raw)

    async def _direct_get(self, subject: str, request: bytes) -> RawRecord | None:
        """A direct get (NATS ADR-31), read straight from the reply's headers: nats-py's
        `get_msg` (stream-name checks, JSON, its time parsing) adds about 20 µs of CPU to each
        lookup, and the spawner makes several lookups for every agent it starts. A lookup the
        server does not answer (restarting, or failing over) is asked again, as the leader's
        lookups are."""
        reply = await while_electing(
            lambda: self.nc.request(subject, request, timeout=LOOKUP_TIMEOUT_S)
        )
        headers = reply.headers or {}
        status = headers.get("Status")
        if status and not reply.data:
            if status == "404":
                return None
            nats.js.errors.APIError.from_msg(reply)  # raises: what the server answered
        return RawRecord(
            seq=int(headers["Nats-Sequence"]),
            subject=headers["Nats-Subject"],
            data=reply.data,
            timestamp=stream_time(datetime.fromisoformat(headers["Nats-Time-Stamp"])),
            headers=headers,
        )

    async def _last_matching(self, filters: list[str]) -> int:
        """The sequence of the newest message matching any of `filters` (0: none)."""
        if filters == ["grove.>"]:
            return await self.last_seq()
        newest = 0
        for subject in filters:
            last = await self.get_last(subject)
            if last is not None:
                newest = max(newest, last.seq)
        return newest

    async def read(
        self,
        from_seq: int = 1,
        *,
        subjects: str | list[str] = "grove.>",
        until_seq: int | None = None,
        follow: bool = False,
        idle_timeout: float | None = None,
    ) -> AsyncGenerator[RawRecord, None]:
        """Replay the stream from `from_seq` in order (`grove_core.replay.OrderedReader`).

        Without `follow`, stops at the last message present when called (or `until_seq`).
        With `follow`, goes on with new messages forever (until the caller stops iterating),
        or until nothing arrives for `idle_timeout` seconds.
        """
        filters = [subjects] if isinstance(subjects, str) else list(subjects)
        if until_seq is None and not follow:
            until_seq = await self._last_matching(filters)
            if until_seq < from_seq:
                return
        reader = OrderedReader(self.nc, self.js, self.stream, filters, from_seq)
        await reader.start()
        # Without `idle_timeout`, a replay up to `until_seq` still looks up every 10 s of
        # silence whether the messages it waits for were removed from the stream meanwhile.
        timeout = idle_timeout if idle_timeout is not None else None if until_seq is None else 10.0
        try:
            taken = 0
            while True:
                record = await reader.next(timeout)
                if record is None:
                    if until_seq is not None and await self.last_seq() < until_seq:
                        return
                    if idle_timeout is not None:
                        return
                    continue
                yield record
                if until_seq is not None and record.seq >= until_seq:
                    return
                taken += 1
                if taken % 1000 == 0:
                    await asyncio.sleep(0)  # let the other tasks run during a long replay
        finally:
            await reader.close()

    async def events(
        self, from_seq: int = 1, **kwargs: Any
    ) -> AsyncIterator[Recorded | tuple[RawRecord, InvalidEvent]]:
        """Like `read`, decoded; invalid messages come as (record, error), dead letters skipped."""
        async for record in self.read(from_seq, **kwargs):
            if is_deadletter(record.subject):
                continue
            try:
                yield decode_record(record)
            except InvalidEvent as exc:
                yield record, exc

    async def wait_for(self, subject: str, timeout: float | None = None) -> Recorded:
        """The first valid event on `subject` (past or future); TimeoutError after `timeout`."""

        async def first() -> Recorded:
            async for item in self.events(1, subjects=subject, follow=True):
                if isinstance(item, Recorded):
                    return item
            raise LogError(f"stopped reading {subject}")

        return await asyncio.wait_for(first(), timeout)

"""Projections: state folded from the log, stored in SQL with the sequence it has applied.

A service's state is a fold of events (`evolve(state, recorded) -> state`, no I/O). The runner
reads the log from checkpoint + 1, folds each event, and writes the rows that changed together
with the new checkpoint in one transaction, in batches. An already-applied sequence is skipped,
so a redelivery is harmless; an empty database replays from sequence 1 to the same state.
"""

from __future__ import annotations

import asyncio
import gc
import heapq
import itertools
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import nats.errors
import orjson
import sqlalchemy.event
import sqlalchemy.exc
from sqlalchemy import (
    JSON,
    BigInteger,
    Column,
    MetaData,
    String,
    Table,
    create_engine,
    delete,
    insert,
    select,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.sql.dml import Insert

from grove_core import collector, metrics
from grove_core.catchup import CatchUpError, read_in_helper
from grove_core.log import EventLog
from grove_core.records import RawRecord, Recorded, decode_record, is_deadletter
from grove_core.rows import FoldState, encode_row
from grove_core.sql import create_tables
from grove_events import InvalidEvent, kind_wildcard

log = logging.getLogger(__name__)

#: Seconds a write waits for a locked SQLite database before it fails.
SQLITE_BUSY_TIMEOUT_S = 5.0

_meta = MetaData()
checkpoints = Table(
    "grove_checkpoints",
    _meta,
    Column("projection", String(64), primary_key=True),
    Column("seq", BigInteger, nullable=False),
)
rows_table = Table(
    "grove_projection_rows",
    _meta,
    Column("projection", String(64), primary_key=True),
    Column("key", String(256), primary_key=True),
    Column("data", JSON, nullable=False),
)
origins = Table(
    "grove_projection_origins",
    _meta,
    Column("projection", String(64), primary_key=True),
    Column("log", String(256), nullable=False),
    Column("fold", String(64), nullable=False),
)
#: The message each checkpoint stands on: its subject and the time the log stored it.
marks = Table(
    "grove_checkpoint_marks",
    _meta,
    Column("projection", String(64), primary_key=True),
    Column("seq", BigInteger, nullable=False),
    Column("subject", String(256), nullable=False),
    Column("stored_ms", BigInteger, nullable=False),
)


@dataclass(frozen=True, slots=True)
class Origin:
    """What a projection's rows were folded from: a log (`EventLog.identity`) and a version
    of the fold (`ProjectionRunner(fold_version=)`)."""

    log: str
    fold: str


@dataclass(frozen=True, slots=True)
class Mark:
    """The message at a checkpoint: where it is in the log, its subject, and when the log
    stored it (milliseconds since the epoch). A log that lost its newest messages reuses
    their sequences for the next ones, so the message found at the checkpoint's sequence then
    differs from its mark."""

    seq: int
    subject: str
    stored_ms: int

    @classmethod
    def of(cls, record: RawRecord) -> Mark:
        """The mark of a record read from the log."""
        return cls(record.seq, record.subject, round(record.timestamp.timestamp() * 1000))


S = TypeVar("S", bound=FoldState)


def _sqlite_normal_sync(dbapi_connection: Any, _record: Any) -> None:
    # In WAL mode, NORMAL keeps every transaction atomic and the database consistent; a power
    # loss may drop the newest transactions, which the log replays from the checkpoint.
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


#: A row in the form the store takes it: JSON text, or JSON-ready data.
Row = str | dict[str, Any]

_SQLITE_UPSERT = (
    "INSERT INTO grove_projection_rows (projection, key, data) VALUES (?, ?, ?) "
    "ON CONFLICT (projection, key) DO UPDATE SET data = excluded.data"
)
_SQLITE_DELETE = "DELETE FROM grove_projection_rows WHERE projection = ? AND key = ?"


def _upsert_rows(dialect: str) -> Insert | None:
    """An insert of rows that replaces a row with the same key, where the database has one."""
    key = [rows_table.c.projection, rows_table.c.key]
    if dialect == "sqlite":
        lite = sqlite.insert(rows_table)
        return lite.on_conflict_do_update(index_elements=key, set_={"data": lite.excluded.data})
    if dialect == "postgresql":
        pg = postgresql.insert(rows_table)
        return pg.on_conflict_do_update(index_elements=key, set_={"data": pg.excluded.data})
    return None


class ProjectionStore:
    """Checkpoint and rows of projections in one SQL database (SQLite by default)."""

    def __init__(self, url: str) -> None:
        self.url = url
        # A locked database fails a write after this long (it is retried); see `write`.
        connect_args = {"timeout": SQLITE_BUSY_TIMEOUT_S} if url.startswith("sqlite") else {}
        self.engine: Engine = create_engine(url, connect_args=connect_args)
        if url.startswith("sqlite"):
            sqlalchemy.event.listen(self.engine, "connect", _sqlite_normal_sync)
            with self.engine.begin() as conn:
                conn.exec_driver_sql("PRAGMA journal_mode=WAL")
        create_tables(_meta, self.engine)
        self._upsert = _upsert_rows(self.engine.dialect.name)
        self._sqlite = self.engine.dialect.name == "sqlite"

    def load(self, projection: str) -> tuple[int, dict[str, dict[str, Any]]]:
        """(checkpoint, rows) of a projection; (0, {}) when it has none."""
        with self.engine.connect() as conn:
            seq = conn.execute(
                select(checkpoints.c.seq).where(checkpoints.c.projection == projection)
            ).scalar()
            rows = conn.execute(
                select(rows_table.c.key, rows_table.c.data).where(
                    rows_table.c.projection == projection
                )
            ).all()
        decoded = {
            key: (orjson.loads(data) if isinstance(data, str) else data) for key, data in rows
        }
        return int(seq or 0), decoded

    def save(
        self,
        projection: str,
        seq: int,
        changed: Mapping[str, Row | None],
        mark: Mark | None = None,
    ) -> None:
        """Write changed rows and the checkpoint in one transaction, with the mark of the
        message at the checkpoint when known. A row is JSON text (as `encode_row` gives it) or
        JSON-ready data; None deletes it."""
        with self.engine.begin() as conn:
            if changed and self._sqlite:
                self._save_sqlite_rows(conn, projection, changed)
            elif changed:
                self._save_rows(conn, projection, changed)
            updated = conn.execute(
                update(checkpoints).where(checkpoints.c.projection == projection).values(seq=seq)
            )
            if updated.rowcount == 0:
                conn.execute(insert(checkpoints).values(projection=projection, seq=seq))
            conn.execute(delete(marks).where(marks.c.projection == projection))
            if mark is not None and mark.seq == seq:
                conn.execute(
                    insert(marks).values(
                        projection=projection,
                        seq=mark.seq,
                        subject=mark.subject,
                        stored_ms=mark.stored_ms,
                    )
                )

    def mark(self, projection: str) -> Mark | None:
        """The mark of the message at the projection's checkpoint (None: not recorded)."""
        with self.engine.connect() as conn:
            row = conn.execute(
                select(marks.c.seq, marks.c.subject, marks.c.stored_ms).where(
                    marks.c.projection == projection
                )
            ).first()
        return None if row is None else Mark(int(row.seq), row.subject, int(row.stored_ms))

    @staticmethod
    def _save_sqlite_rows(
        conn: Connection, projection: str, changed: Mapping[str, Row | None]
    ) -> None:
        # Straight to the driver with the JSON text: SQLAlchemy's per-row processing of a JSON
        # column cost more than SQLite's own work for the thousands of rows a replay writes.
        gone = [(projection, key) for key, row in changed.items() if row is None]
        live = [
            (projection, key, row if isinstance(row, str) else encode_row(row))
            for key, row in changed.items()
            if row is not None
        ]
        if gone:
            conn.exec_driver_sql(_SQLITE_DELETE, gone)
        if live:
            conn.exec_driver_sql(_SQLITE_UPSERT, live)

    def _save_rows(
        self, conn: Connection, projection: str, changed: Mapping[str, Row | None]
    ) -> None:
        live = [
            {
                "projection": projection,
                "key": key,
                "data": orjson.loads(row) if isinstance(row, str) else row,
            }
            for key, row in changed.items()
            if row is not None
        ]
        # With an upsert, only removed rows are deleted; without, every changed one.
        upsert = self._upsert
        stale = [key for key, row in changed.items() if row is None or upsert is None]
        for start in range(0, len(stale), 500):
            conn.execute(
                delete(rows_table).where(
                    rows_table.c.projection == projection,
                    rows_table.c.key.in_(stale[start : start + 500]),
                )
            )
        if live:
            conn.execute(insert(rows_table) if upsert is None else upsert, live)

    def origin(self, projection: str) -> Origin | None:
        """What the projection's rows were folded from (None: not recorded)."""
        with self.engine.connect() as conn:
            row = conn.execute(
                select(origins.c.log, origins.c.fold).where(origins.c.projection == projection)
            ).first()
        return None if row is None else Origin(log=row.log, fold=row.fold)

    def set_origin(self, projection: str, origin: Origin, *, discard: bool) -> None:
        """Record what the projection is folded from; with `discard`, its rows and checkpoint
        are deleted in the same transaction (it starts again from an empty state)."""
        with self.engine.begin() as conn:
            if discard:
                conn.execute(delete(rows_table).where(rows_table.c.projection == projection))
                conn.execute(delete(checkpoints).where(checkpoints.c.projection == projection))
                conn.execute(delete(marks).where(marks.c.projection == projection))
            conn.execute(delete(origins).where(origins.c.projection == projection))
            conn.execute(
                insert(origins).values(projection=projection, log=origin.log, fold=origin.fold)
            )

    def close(self) -> None:
        """Release the connection pool."""
        self.engine.dispose()


#: Seconds between looks at the log's end while `reached` waits for the log to come as far as
#: it was asked (a runner that follows only its kinds hears of no other message).
REACHED_POLL_S = 0.05
#: Seconds between attempts to make the filtered consumer of a runner that follows only its
#: kinds, while the server does not answer.
FOLLOW_RETRY_S = 0.5

#: The cyclic garbage collector's first threshold while a runner catches up (Python's: 700).
CATCH_UP_GC_THRESHOLD = 50_000


class _FewerCollections:
    """Raises the collector's first threshold while any runner of the process catches up.

    A catch-up allocates a few objects per event, nearly all freed by their reference counts
    at once, and builds a large long-lived state that each collection walks again. At
    Python's default threshold a 1,000,000-event governor rebuild spent 1.3 s of its 22 s
    in collections and ran 10 % faster with this one. The threshold is put back once every
    runner has caught up (or stopped).
    """

    def __init__(self) -> None:
        self._runners = 0
        self._saved: tuple[int, int, int] | None = None

    def enter(self) -> None:
        if self._runners == 0:
            self._saved = gc.get_threshold()
            first, *older = self._saved
            gc.set_threshold(max(first, CATCH_UP_GC_THRESHOLD), *older)
        self._runners += 1

    def leave(self) -> None:
        self._runners -= 1
        if self._runners == 0 and self._saved is not None:
            gc.set_threshold(*self._saved)
            self._saved = None


_COLLECTIONS = _FewerCollections()

Evolve = Callable[[S, Recorded], S]
AfterEvent = Callable[[Recorded, bool], Awaitable[None]]
CaughtUp = Callable[[], Awaitable[None]]


class ProjectionRunner(Generic[S]):
    """Folds the log into a state and keeps its projection and checkpoint in SQL.

    `after_event(recorded, live)` runs after each event is folded, `live` once the runner has
    caught up with what was in the log when it started; `caught_up` is set at that moment.

    `kinds` names the event kinds that `evolve` and `after_event` read (None: all). Messages of
    other kinds are passed over undecoded (their sequence still counts as applied); the
    services that read them validate them and dead-letter what is invalid.

    With `follow_kinds_only`, a runner that has caught up follows the log through a consumer
    the server filters to its kinds: the messages of other kinds are not sent to it at all,
    which pays where its kinds are a small share of the log (the artifact-store folds one
    event in five of an agent's life). The catch-up reads every message all the same, as
    nats-server reads a long stretch of many subjects for a consumer with several filters
    far more slowly than for one without. `applied_seq` then stays at the last message of its
    kinds, and `reached` asks the log whether any message of its kinds lies before the
    position it is asked for.

    Changed rows are written every `batch_size` events and every `flush_interval` seconds
    once caught up, in a worker thread; during the catch-up, every `catch_up_batch_size`
    events on the loop's own thread (a larger batch: each commit of SQLite's costs about as
    much as writing a few hundred rows). A row changed several times between two writes is
    encoded and written once: in bursts of agents, writing every second instead of every
    quarter second took 7-8 % off the router's and the governor's CPU. The log is the record;
    a service that stops without its last write replays that second at its next start.

    The stored rows are only resumed from their checkpoint when they were folded from this
    log (not from a stream of the same name deleted and made again), by a fold of the same
    `fold_version`, and the log still holds the message the checkpoint stands on (its `Mark`:
    a log that lost its newest messages either ends before the checkpoint or has other
    messages at those sequences).
    Otherwise they are deleted and the log is replayed from sequence 1: a service whose fold
    changes what it keeps bumps its version, and the next start rebuilds its state.
    """

    def __init__(
        self,
        *,
        name: str,
        log: EventLog,
        store: ProjectionStore,
        state_type: type[S],
        evolve: Evolve[S],
        after_event: AfterEvent | None = None,
        on_caught_up: CaughtUp | None = None,
        kinds: frozenset[str] | None = None,
        follow_kinds_only: bool = False,
        fold_version: str = "1",
        batch_size: int = 4000,
        catch_up_batch_size: int = 5000,
        flush_interval: float = 1.0,
    ) -> None:
        self.name = name
        self.log = log
        self.store = store
        self.state_type = state_type
        self.evolve = evolve
        self.after_event = after_event
        self.on_caught_up = on_caught_up
        if follow_kinds_only and not kinds:
            raise ValueError("follow_kinds_only needs the kinds the projection reads")
        self.kinds = kinds
        self.follow_kinds_only = follow_kinds_only
        self.fold_version = fold_version
        self.batch_size = batch_size
        self.catch_up_batch_size = catch_up_batch_size
        self.flush_interval = flush_interval
        self.caught_up = asyncio.Event()
        self.applied_seq = 0
        self.flushed_seq = 0
        #: The last record applied (its mark is written with the checkpoint).
        self._applied: RawRecord | None = None
        #: Messages in the log after the last one applied, as the consumer last reported.
        self.lag = 0
        self.state: S = state_type.from_rows({})
        self._applied_metric = metrics.EVENTS_APPLIED.labels(name)
        #: Events folded since the counter was last told (it is told at each write: a
        #: Prometheus counter takes a lock, which is a tenth of a replay's step).
        self._uncounted = 0
        #: Rows taken for a write that failed (or is under way): written with the next one.
        self._unsaved: dict[str, str | None] = {}
        #: Why the last write failed (None: it succeeded).
        self.write_error: str | None = None
        self._write_lock = asyncio.Lock()
        self._writing: asyncio.Future[None] | None = None
        #: Whether this runner holds the collector's threshold up (see `_FewerCollections`).
        self._collecting_less = False
        #: Callers of `reached` waiting: (sequence, tie-breaker, future), the lowest first.
        self._reach_waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._reach_tickets = itertools.count()

    def load(self) -> S:
        """Load state and checkpoint from the store."""
        seq, rows = self.store.load(self.name)
        self.state = self.state_type.from_rows(rows)
        self.applied_seq = self.flushed_seq = seq
        return self.state

    def flush(self) -> None:
        """Write what changed since the last flush, with the checkpoint (blocking: for the
        last write at shutdown, and tests; the running service writes with `write`)."""
        self._count_applied()
        if self.applied_seq == self.flushed_seq:
            return
        seq = self.applied_seq
        changed = {**self._unsaved, **self.state.take_dirty_json()}
        try:
            self.store.save(self.name, seq, changed, self._mark(seq))
        except BaseException:
            self._unsaved = changed  # written with the next flush, newer changes over them
            raise
        self._written(seq)

    async def write(self) -> bool:
        """Write what changed, in a worker thread so the service goes on meanwhile; False
        when the database refused (the rows are kept for the next write, `write_error` says
        why and the service reports not ready until a write succeeds)."""
        async with self._write_lock:
            self._count_applied()
            if self.applied_seq == self.flushed_seq:
                return True
            seq = self.applied_seq
            changed = {**self._unsaved, **self.state.take_dirty_json()}
            self._unsaved = changed  # until it is written
            self._writing = asyncio.ensure_future(
                asyncio.to_thread(self.store.save, self.name, seq, changed, self._mark(seq))
            )
            try:
                await asyncio.shield(self._writing)  # a cancelled caller leaves it to finish
            except Exception as exc:  # noqa: BLE001 - any database failure is reported alike
                self._write_failed(exc)
                return False
            self._written(seq)
            return True

    def _mark(self, seq: int) -> Mark | None:
        """The mark of the message at `seq`, when it is the last one applied."""
        applied = self._applied
        return Mark.of(applied) if applied is not None and applied.seq == seq else None

    def _count_applied(self) -> None:
        if self._uncounted:
            self._applied_metric.inc(self._uncounted)
            self._uncounted = 0

    def _written(self, seq: int) -> None:
        self._unsaved = {}
        self.flushed_seq = seq
        if self.write_error is not None:
            log.warning("%s: the database takes writes again (checkpoint %s)", self.name, seq)
            self.write_error = None
        metrics.PROJECTION_SEQ.labels(self.name).set(seq)
        metrics.PROJECTION_LAG.labels(self.name).set(self.lag)

    def _write_failed(self, exc: Exception) -> None:
        metrics.PROJECTION_WRITE_ERRORS.labels(self.name).inc()
        # The database's own error, without the statement and rows SQLAlchemy adds to it.
        cause = exc.orig if isinstance(exc, sqlalchemy.exc.DBAPIError) else exc
        reason = f"{cause.__class__.__name__}: {cause}"
        if self.write_error is None:
            log.error(
                "%s: cannot write the projection (%s); folding goes on in memory, the write is "
                "retried every %gs, and the service reports not ready until it succeeds",
                self.name,
                reason,
                self.flush_interval,
            )
        self.write_error = reason

    @property
    def writable(self) -> bool:
        """Whether the last write to the database succeeded."""
        return self.write_error is None

    def ready(self) -> bool:
        """Caught up with the log, and the database takes writes (the readiness check)."""
        return self.caught_up.is_set() and self.writable

    async def run(self) -> None:
        """Replay from checkpoint + 1, then follow the log until cancelled (writing then)."""
        started = time.perf_counter()
        self.log.own.keep()  # what the log's connection appends from now on is folded here too
        last_seq = await self._load_checked()
        if last_seq <= self.applied_seq:
            await self._mark_caught_up(started)
        else:
            _COLLECTIONS.enter()
            self._collecting_less = True
        flusher = asyncio.create_task(self._write_periodically())
        records = self._records()
        try:
            async for raw in records:
                if raw.seq <= self.applied_seq:
                    continue
                live = self.caught_up.is_set()
                if self._reads(raw.subject):
                    try:
                        recorded = self.log.own.recorded(raw) or decode_record(raw)
                    except InvalidEvent as exc:
                        await self._dead_letter(raw, exc)
                    else:
                        self.state = self.evolve(self.state, recorded)
                        self._uncounted += 1
                        if self.after_event is not None:
                            await self.after_event(recorded, live)
                self.applied_seq = raw.seq
                self._applied = raw
                self.lag = raw.pending
                if self._reach_waiters and self._reach_waiters[0][0] <= raw.seq:
                    self._wake_reached()
                if not live and raw.pending == 0:
                    await self._mark_caught_up(started)
                if not self.writable:
                    continue  # the periodic writer retries
                unwritten = self.applied_seq - self.flushed_seq
                if live and unwritten >= self.batch_size:
                    await self.write()
                elif not live and unwritten >= self.catch_up_batch_size:
                    self._write_inline()
        finally:
            await records.aclose()  # ends a catch-up helper and the replay's consumer now
            self._collect_as_usual()
            flusher.cancel()
            if self._writing is not None and not self._writing.done():
                await asyncio.wait([self._writing])  # never two writes at once
            try:
                self.flush()
            except Exception:
                log.exception("%s: the last write failed; the log replays it", self.name)

    async def _load_checked(self) -> int:
        """Load the stored state, or start again from an empty one where it cannot be resumed
        on this log (`_check_origin`); the sequence of the log's newest message."""
        self.load()
        identity, last_seq = await self.log.identity()
        here = Origin(log=identity, fold=self.fold_version)
        self._check_origin(here, last_seq, await self._moved_checkpoint(last_seq))
        return last_seq

    async def _moved_checkpoint(self, last_seq: int) -> str | None:
        """How the message at the checkpoint differs from its mark (None: it does not, or
        cannot be told: no mark, the message was removed by the stream's limits, or the log
        ends before it)."""
        mark = self.store.mark(self.name)
        if mark is None or mark.seq != self.applied_seq or mark.seq > last_seq:
            return None
        found = await self.log.get_next(">", mark.seq)
        if found is None or found.seq != mark.seq:
            return None
        now = Mark.of(found)
        if now == mark:
            return None
        return (
            f"the message at its checkpoint (seq {mark.seq}) is now {now.subject} stored at "
            f"{now.stored_ms} ms, not {mark.subject} stored at {mark.stored_ms} ms: the log "
            "lost messages it had folded, and later ones took their sequences"
        )

    def _check_origin(self, here: Origin, last_seq: int, moved: str | None = None) -> None:
        """Keep the loaded state if it was folded from this log by this fold, and the log
        still holds the message at its checkpoint; otherwise start again from an empty state
        (see the class). `moved` says how the message at the checkpoint changed, if it did."""
        stored = self.store.origin(self.name)
        if self.applied_seq <= last_seq and moved is None and stored in (here, None):
            if stored is None:  # a new projection, or one stored before origins were
                self.store.set_origin(self.name, here, discard=False)
            return
        if stored is not None and stored.log != here.log:
            cause = "log"
            why = f"it was folded from {stored.log}, and the log is now {here.log}"
        elif stored is not None and stored.fold != here.fold:
            cause = "fold"
            why = f"it was folded by version {stored.fold} of the fold, this is {here.fold}"
        elif moved is not None:
            cause = "checkpoint"
            why = moved
        else:
            cause = "checkpoint"
            why = (
                f"its checkpoint (seq {self.applied_seq}) is past the log's end "
                f"(seq {last_seq}): the log lost messages it had folded"
            )
        log.warning(
            "%s: the stored projection is deleted and the log replayed from seq 1: %s",
            self.name,
            why,
        )
        metrics.PROJECTION_REBUILDS.labels(self.name, cause).inc()
        self.store.set_origin(self.name, here, discard=True)
        self.load()

    async def _records(self) -> AsyncGenerator[RawRecord, None]:
        """The log from the checkpoint on, forever. A catch-up of at least the log's
        `helper.min_events` events is read by a helper process (`grove_core.catchup`); if the
        helper fails, this process reads on from where it stopped."""
        next_seq = self.applied_seq + 1
        helper = self.log.helper
        if helper is not None:
            last = await self.log.last_seq()
            if last - self.applied_seq >= helper.min_events:
                log.info(
                    "%s: %s events behind; a helper process reads them",
                    self.name,
                    last - self.applied_seq,
                )
                helped = read_in_helper(
                    helper.access, self.log.stream, next_seq, last, name=f"{self.name}-catch-up"
                )
                try:
                    async for raw in helped:
                        next_seq = raw.seq + 1
                        yield raw
                except CatchUpError as exc:
                    metrics.CATCH_UP_HELPER_FAILURES.labels(self.name).inc()
                    log.warning("%s: %s; reading on from seq %s here", self.name, exc, next_seq)
                finally:
                    await helped.aclose()
        while True:
            filtered = self.follow_kinds_only and self.caught_up.is_set()
            subjects = self._kind_subjects() if filtered else "grove.>"
            replay = self.log.read(next_seq, subjects=subjects, follow=True)
            try:
                async for raw in replay:
                    next_seq = raw.seq + 1
                    yield raw
                    if not filtered and self.follow_kinds_only and self.caught_up.is_set():
                        break  # caught up with this record: from the next one, only its kinds
                else:
                    return
            except (nats.errors.Error, TimeoutError) as exc:
                if not filtered:
                    raise
                # The server went away as the filtered consumer was made (a reader that runs
                # makes its consumer again by itself): try again from the same place.
                log.warning("%s: cannot follow the log yet (%s); trying again", self.name, exc)
                await asyncio.sleep(FOLLOW_RETRY_S)
            finally:
                await replay.aclose()

    def _kind_subjects(self) -> list[str]:
        assert self.kinds is not None
        return [kind_wildcard(kind) for kind in sorted(self.kinds)]

    async def reached(self, seq: int, timeout: float) -> bool:
        """Wait until the state has folded the log up to `seq`; False if it has not within
        `timeout` seconds."""
        if not self.follow_kinds_only:
            return await self._reached_applied(seq, timeout)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.applied_seq < seq:
            remaining = deadline - loop.time()
            if self.caught_up.is_set():
                return await self._reached_kinds(seq, remaining)
            if remaining <= 0:
                return False
            # Catching up, every message comes; once caught up, only those of its kinds.
            await self._reached_applied(seq, min(remaining, REACHED_POLL_S * 10))
        return True

    async def _reached_kinds(self, seq: int, timeout: float) -> bool:
        """`reached` for a runner that follows only its kinds: the messages after
        `applied_seq` up to `seq` may all be of other kinds, which never come to it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.applied_seq < seq:
            following = await self._next_of_kinds(self.applied_seq + 1)
            if following is None:
                # Nothing of its kinds after what was folded. Looked up again once the log
                # holds `seq`, still nothing: nothing of its kinds lies before `seq`.
                if await self.log.last_seq() >= seq:
                    following = await self._next_of_kinds(self.applied_seq + 1)
                    if following is None:
                        return True
                else:  # the log has not come that far: look again in a moment
                    remaining = deadline - loop.time()
                    if remaining <= 0:
                        return False
                    await asyncio.sleep(min(REACHED_POLL_S, remaining))
                    continue
            if following > seq:  # stored, so every message before it is too
                return True
            if not await self._reached_applied(following, deadline - loop.time()):
                return False
        return True

    async def _next_of_kinds(self, from_seq: int) -> int | None:
        """The sequence of the first message of the projection's kinds at or after
        `from_seq` (None: there is none)."""
        found = await asyncio.gather(
            *(self.log.get_next(subject, from_seq) for subject in self._kind_subjects())
        )
        return min((record.seq for record in found if record is not None), default=None)

    async def _reached_applied(self, seq: int, timeout: float) -> bool:
        """Wait until `applied_seq` is at least `seq`."""
        if self.applied_seq >= seq:
            return True
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (seq, next(self._reach_tickets), future)
        heapq.heappush(self._reach_waiters, entry)
        try:
            async with asyncio.timeout(timeout):
                await future
        except TimeoutError:
            return False
        finally:
            if not future.done():
                future.cancel()  # dropped from the heap when it comes to the top
        return True

    def _wake_reached(self) -> None:
        waiters = self._reach_waiters
        while waiters and waiters[0][0] <= self.applied_seq:
            _, _, future = heapq.heappop(waiters)
            if not future.done():
                future.set_result(None)

    def _reads(self, subject: str) -> bool:
        """Whether the message on `subject` is an event this projection decodes."""
        if is_deadletter(subject):
            return False
        if self.kinds is None:
            return True
        parts = subject.split(".", 2)
        return len(parts) < 2 or parts[1] in self.kinds

    def _write_inline(self) -> None:
        """Write on the event loop's thread, for the batches of a catch-up.

        Nothing waits on the loop then but the fold itself, and a worker thread would contend
        with the fold for the GIL at every row: writes in a thread took three to four times
        as long during a rebuild.
        """
        try:
            self.flush()
        except Exception as exc:  # noqa: BLE001 - any database failure is reported alike
            self._write_failed(exc)

    async def _write_periodically(self) -> None:
        while True:
            await asyncio.sleep(self.flush_interval)
            # A catch-up writes its own batches; a refused write is retried all the same.
            if self.caught_up.is_set() or not self.writable:
                await self.write()

    def _collect_as_usual(self) -> None:
        if self._collecting_less:
            self._collecting_less = False
            _COLLECTIONS.leave()

    async def _mark_caught_up(self, started: float) -> None:
        self._collect_as_usual()
        collector.caught_up()
        metrics.REPLAY_SECONDS.labels(self.name).set(time.perf_counter() - started)
        await self.write()
        self.caught_up.set()
        log.info("%s caught up at seq %s", self.name, self.applied_seq)
        if self.on_caught_up is not None:
            await self.on_caught_up()

    async def _dead_letter(self, raw: Any, exc: InvalidEvent) -> None:
        metrics.DEADLETTERS.labels(self.name, exc.kind).inc()
        log.warning("invalid message at seq %s on %s: %s", raw.seq, raw.subject, exc.reason)
        try:
            await self.log.record_invalid(raw, exc, self.name)
        except Exception:
            log.exception("could not record dead letter for seq %s", raw.seq)

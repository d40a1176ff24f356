"""Sessions: the transcript of each agent session, persisted as the agent runs.

A session is an ordered list of entries (`system`, `user`, `assistant`, `tool_call`,
`tool_result`). A resumed agent goes on with its session; a fork starts a new session from a
copy of its source's, up to the fork, followed by a fork-context `system` entry.

Where it lives: any spawner may resume or fork any agent, so every spawner must read the same
sessions. With `GROVE_DATABASE_URL` set (PostgreSQL in production) the sessions are in that
database; with the default per-spawner SQLite files, they are in one file shared by the spawners
of the data folder, `<GROVE_DATA_DIR>/sessions.db` (spawners on several hosts need the shared
database URL).

The opening entries of a session are computed by pure functions (`spawn_opening`,
`fork_opening`, `resume_opening`); `SessionStore` is the SQL side.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from sqlalchemy import (
    BigInteger,
    Column,
    DateTime,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    create_engine,
    event,
    insert,
    select,
)
from sqlalchemy.engine import Connection, Engine

from agentgrove.context import EntryKind, SessionEntry, StartKind, check_entry_kind
from grove_core.settings import ServiceSettings
from grove_core.sql import create_tables
from grove_events import ForkEvent, SpawnEvent

SESSIONS_FILE = "sessions.db"

_meta = MetaData()
entries_table = Table(
    "grove_session_entries",
    _meta,
    Column(
        "id",
        BigInteger().with_variant(Integer, "sqlite"),
        primary_key=True,
        autoincrement=True,
    ),
    Column("session_id", String(128), nullable=False, index=True),
    Column("agent_id", String(128), nullable=True),
    Column("kind", String(16), nullable=False),
    Column("content", Text, nullable=False),
    Column("time", DateTime(timezone=True), nullable=False),
)


def sessions_database_url(settings: ServiceSettings) -> str:
    """Where sessions live: the shared database when one is set, else the data folder's file."""
    if settings.database_url:
        return settings.database_url
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{(settings.data_dir / SESSIONS_FILE).resolve()}"


# -- what a session starts with (pure) ---------------------------------------------------------


def fork_context_message(source_agent: str, reason: str, task: str | None = None) -> str:
    """The system entry that tells a fork what it is."""
    text = (
        f"You are a fork of agent {source_agent}. Everything above is a copy of its session "
        f"up to the moment it was forked. You were forked because: {reason}. "
        f"Agent {source_agent} keeps running on its own and is not told about you: do not "
        "expect it to see your work or to wait for you. From here on you are a separate agent "
        "with your own id and your own result."
    )
    if task:
        text += " Your task from here is the next user message."
    return text


def spawn_opening(spawn: SpawnEvent, now: datetime) -> list[SessionEntry]:
    """A new session: the initial context (system) if any, then the task (user)."""
    entries = []
    if spawn.initial_context:
        entries.append(SessionEntry("system", spawn.initial_context, now, spawn.agent_id))
    entries.append(SessionEntry("user", spawn.task, now, spawn.agent_id))
    return entries


def fork_opening(
    source: Sequence[SessionEntry], fork: ForkEvent, now: datetime
) -> list[SessionEntry]:
    """A fork's session: the source's entries up to the fork, the fork context, and the fork's
    own task and first message (user) when it has them."""
    cut = fork.timestamp
    copied = [e for e in source if cut is None or e.time <= cut]
    entries = [
        *copied,
        SessionEntry(
            "system",
            fork_context_message(fork.source_agent, fork.reason, fork.task),
            now,
            fork.agent_id,
        ),
    ]
    if fork.task:
        entries.append(SessionEntry("user", fork.task, now, fork.agent_id))
    if fork.initial_message:
        entries.append(SessionEntry("user", fork.initial_message, now, fork.agent_id))
    return entries


def resume_opening(agent_id: str, message: str | None, now: datetime) -> list[SessionEntry]:
    """What a resume adds: its message (user), if it has one."""
    return [] if message is None else [SessionEntry("user", message, now, agent_id)]


# -- storage -------------------------------------------------------------------------------


def _as_utc(value: datetime) -> datetime:
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


#: How a SQLite session file is synced (`GROVE_SESSION_SYNC`): `normal` syncs at WAL
#: checkpoints, so a crash of the process loses nothing and a power loss may lose the newest
#: entries (as nats-server's default, which syncs every two minutes, may lose the newest
#: events); `full` syncs every transaction (for a server run with `sync_interval: always`).
SessionSync = Literal["normal", "full"]


def _sqlite_for_many_writers(engine: Engine, sync: SessionSync) -> None:
    """WAL, the sync level, and transactions that take the write lock when they begin.

    Several spawner processes write the shared file; a transaction that reads and then
    writes would otherwise fail at once (not wait) when another process wrote in between.
    """

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _: Any) -> None:
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA synchronous={sync.upper()}")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _begin_immediate(conn: Connection) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")


@dataclass(frozen=True)
class SessionOpen:
    """What opening one agent instance's session needs (see `SessionStore.open`)."""

    kind: StartKind
    spawn: SpawnEvent
    now: datetime
    fork: ForkEvent | None = None
    source_session: str | None = None
    resume_message: str | None = None

    @property
    def session_id(self) -> str:
        """The session opened: the spawn's, else named after the agent."""
        return self.spawn.session_id or self.spawn.agent_id


class SessionStore:
    """Session entries in one SQL database (see the module's note on which)."""

    def __init__(self, url: str, sync: SessionSync = "normal") -> None:
        self.url = url
        connect_args = {"timeout": 30} if url.startswith("sqlite") else {}
        self.engine: Engine = create_engine(url, connect_args=connect_args)
        if url.startswith("sqlite"):
            _sqlite_for_many_writers(self.engine, sync)
        create_tables(_meta, self.engine)

    @classmethod
    def _entries(cls, conn: Connection, session_id: str) -> list[SessionEntry]:
        return cls._entries_of(conn, {session_id}).get(session_id, [])

    @staticmethod
    def _entries_of(conn: Connection, session_ids: set[str]) -> dict[str, list[SessionEntry]]:
        """The entries of several sessions (those that have any), read together."""
        found: dict[str, list[SessionEntry]] = {}
        ids = sorted(session_ids)
        for start in range(0, len(ids), 500):
            rows = conn.execute(
                select(
                    entries_table.c.session_id,
                    entries_table.c.kind,
                    entries_table.c.content,
                    entries_table.c.time,
                    entries_table.c.agent_id,
                )
                .where(entries_table.c.session_id.in_(ids[start : start + 500]))
                .order_by(entries_table.c.id)
            ).all()
            for session_id, kind, content, stamped, agent_id in rows:
                entry = SessionEntry(check_entry_kind(kind), content, _as_utc(stamped), agent_id)
                found.setdefault(session_id, []).append(entry)
        return found

    @staticmethod
    def _append_rows(conn: Connection, rows: Sequence[tuple[str, SessionEntry]]) -> None:
        if rows:
            conn.execute(
                insert(entries_table),
                [
                    {
                        "session_id": session_id,
                        "agent_id": e.agent_id,
                        "kind": e.kind,
                        "content": e.content,
                        "time": _as_utc(e.time),
                    }
                    for session_id, e in rows
                ],
            )

    def entries(self, session_id: str) -> list[SessionEntry]:
        """A session's entries, oldest first (empty for an unknown session)."""
        with self.engine.connect() as conn:
            return self._entries(conn, session_id)

    def append(self, session_id: str, entries: Sequence[SessionEntry]) -> None:
        """Append entries to a session, in order, in one transaction."""
        with self.engine.begin() as conn:
            self._append_rows(conn, [(session_id, entry) for entry in entries])

    def open(
        self,
        kind: StartKind,
        spawn: SpawnEvent,
        *,
        fork: ForkEvent | None = None,
        source_session: str | None = None,
        resume_message: str | None = None,
        now: datetime,
    ) -> list[SessionEntry]:
        """Begin an agent instance's session and return its entries.

        A spawn or a fork opens the session only when it has no entries yet (a start that is
        tried again finds its opening there); a resume appends its message.
        """
        request = SessionOpen(kind, spawn, now, fork, source_session, resume_message)
        return self.open_many([request])[0]

    def open_many(self, requests: Sequence[SessionOpen]) -> list[list[SessionEntry]]:
        """Open several sessions in one transaction, each as `open` would, in order (a later
        one sees what an earlier one wrote); one transaction fails them all."""
        with self.engine.begin() as conn:
            sessions = self._entries_of(conn, {request.session_id for request in requests})
            opened = []
            added_rows: list[tuple[str, SessionEntry]] = []
            for request in requests:
                existing = sessions.setdefault(request.session_id, [])
                if request.kind == "resume":
                    added = resume_opening(
                        request.spawn.agent_id, request.resume_message, request.now
                    )
                elif existing:
                    added = []
                elif request.kind == "fork":
                    fork = request.fork
                    assert fork is not None, "a fork's session opens from its fork event"
                    source_id = request.source_session or fork.source_agent
                    source = sessions.get(source_id)
                    if source is None:
                        source = sessions[source_id] = self._entries(conn, source_id)
                    added = fork_opening(source, fork, request.now)
                else:
                    added = spawn_opening(request.spawn, request.now)
                opened.append(existing + added)
                existing.extend(added)
                added_rows.extend((request.session_id, entry) for entry in added)
            self._append_rows(conn, added_rows)
        return opened

    def close(self) -> None:
        """Release the connection pool."""
        self.engine.dispose()


class SessionOpener:
    """Opens sessions off the event loop, in groups: the opens asked for while a group is
    being written go together in the next transaction. When many agents start at once, one
    transaction (and one sync of the file) serves many of them, not one each."""

    def __init__(self, store: SessionStore) -> None:
        self.store = store
        self._waiting: list[tuple[SessionOpen, asyncio.Future[list[SessionEntry]]]] = []
        self._writer: asyncio.Task[None] | None = None

    async def open(self, request: SessionOpen) -> list[SessionEntry]:
        """The session's entries once it is open (see `SessionStore.open`)."""
        future: asyncio.Future[list[SessionEntry]] = asyncio.get_running_loop().create_future()
        self._waiting.append((request, future))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write(), name="session-opener")
        return await future

    async def _write(self) -> None:
        group: list[tuple[SessionOpen, asyncio.Future[list[SessionEntry]]]] = []
        try:
            while self._waiting:
                group, self._waiting = self._waiting, []
                results = await self._open_group([request for request, _ in group])
                for (_, future), result in zip(group, results, strict=True):
                    if future.done():  # its caller went away; the session is open anyway
                        continue
                    if isinstance(result, BaseException):
                        future.set_exception(result)
                    else:
                        future.set_result(result)
                group = []
        finally:
            for _, future in [*group, *self._waiting]:
                if not future.done():
                    future.cancel()

    async def _open_group(
        self, requests: list[SessionOpen]
    ) -> list[list[SessionEntry] | BaseException]:
        try:
            return list(await asyncio.to_thread(self.store.open_many, requests))
        except Exception as exc:  # noqa: BLE001 - handed to the caller that asked
            if len(requests) == 1:
                return [exc]
        # One bad open must not fail the others with it: each alone, in order.
        results: list[list[SessionEntry] | BaseException] = []
        for request in requests:
            try:
                results.append((await asyncio.to_thread(self.store.open_many, [request]))[0])
            except Exception as exc:  # noqa: BLE001 - handed to the caller that asked
                results.append(exc)
        return results


class StoredSession:
    """One agent instance's session: entries in memory, each new one written to the store."""

    def __init__(
        self,
        store: SessionStore,
        session_id: str,
        agent_id: str,
        entries: list[SessionEntry],
    ) -> None:
        self.store = store
        self.session_id = session_id
        self.agent_id = agent_id
        self._entries = list(entries)
        self._lock = asyncio.Lock()

    @property
    def entries(self) -> list[SessionEntry]:
        """Entries so far, oldest first."""
        return list(self._entries)

    async def record(self, kind: EntryKind, content: str) -> SessionEntry:
        """Write an entry, then keep it; entries are written in the order recorded."""
        entry = SessionEntry(check_entry_kind(kind), content, datetime.now(UTC), self.agent_id)
        async with self._lock:
            await asyncio.to_thread(self.store.append, self.session_id, [entry])
            self._entries.append(entry)
        return entry

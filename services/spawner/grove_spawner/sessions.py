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
import time
from collections.abc import Sequence
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
from sqlalchemy.exc import IntegrityError, OperationalError, ProgrammingError

from agentgrove.context import EntryKind, SessionEntry, StartKind, check_entry_kind
from grove_core.settings import ServiceSettings
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


class SessionStore:
    """Session entries in one SQL database (see the module's note on which)."""

    def __init__(self, url: str, sync: SessionSync = "normal") -> None:
        self.url = url
        connect_args = {"timeout": 30} if url.startswith("sqlite") else {}
        self.engine: Engine = create_engine(url, connect_args=connect_args)
        if url.startswith("sqlite"):
            _sqlite_for_many_writers(self.engine, sync)
        self._create_tables()

    def _create_tables(self, attempts: int = 5) -> None:
        # Spawners share this database and may start together: a table created by another
        # one between the check and the CREATE is found by the next check.
        for attempt in range(attempts):
            try:
                _meta.create_all(self.engine)
            except (OperationalError, ProgrammingError, IntegrityError):
                if attempt == attempts - 1:
                    raise
                time.sleep(0.1 * (attempt + 1))
            else:
                return

    @staticmethod
    def _entries(conn: Connection, session_id: str) -> list[SessionEntry]:
        rows = conn.execute(
            select(
                entries_table.c.kind,
                entries_table.c.content,
                entries_table.c.time,
                entries_table.c.agent_id,
            )
            .where(entries_table.c.session_id == session_id)
            .order_by(entries_table.c.id)
        ).all()
        return [
            SessionEntry(check_entry_kind(kind), content, _as_utc(time), agent_id)
            for kind, content, time, agent_id in rows
        ]

    @staticmethod
    def _append(conn: Connection, session_id: str, entries: Sequence[SessionEntry]) -> None:
        if entries:
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
                    for e in entries
                ],
            )

    def entries(self, session_id: str) -> list[SessionEntry]:
        """A session's entries, oldest first (empty for an unknown session)."""
        with self.engine.connect() as conn:
            return self._entries(conn, session_id)

    def append(self, session_id: str, entries: Sequence[SessionEntry]) -> None:
        """Append entries to a session, in order, in one transaction."""
        with self.engine.begin() as conn:
            self._append(conn, session_id, entries)

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
        session_id = spawn.session_id or spawn.agent_id
        with self.engine.begin() as conn:
            existing = self._entries(conn, session_id)
            if kind == "resume":
                added = resume_opening(spawn.agent_id, resume_message, now)
            elif existing:
                added = []
            elif kind == "fork":
                assert fork is not None, "a fork's session opens from its fork event"
                source = self._entries(conn, source_session or fork.source_agent)
                added = fork_opening(source, fork, now)
            else:
                added = spawn_opening(spawn, now)
            self._append(conn, session_id, added)
        return existing + added

    def close(self) -> None:
        """Release the connection pool."""
        self.engine.dispose()


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

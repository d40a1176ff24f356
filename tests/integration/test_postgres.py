"""PostgreSQL (`GROVE_DATABASE_URL`, the production overlay's database) against a real server.

The projection store's other dialect, the services' projections and the spawner's sessions in
PostgreSQL: the same rows as SQLite keeps for the same log, and a whole stack that runs a tree,
restarts and resumes on it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, func, select

from agentgrove.client import GroveClient, build_config
from agentgrove.stack import Stack
from grove_core.log import EventLog
from grove_core.projection import Origin, ProjectionStore
from grove_core.rows import encode_row
from grove_spawner.sessions import SessionStore, entries_table
from tests.integration.test_log import spawn_event, status_event
from tests.integration.test_projection_origin import Folded
from tests.integration.test_recovery import REBUILT, wait_ended
from tests.postgres import LocalPostgres

pytestmark = pytest.mark.integration

StackFactory = Callable[..., Stack]


def test_the_store_keeps_rows_checkpoints_and_origins(postgres: LocalPostgres) -> None:
    store = ProjectionStore(postgres.database())
    try:
        assert store.load("gov") == (0, {})
        store.save("gov", 5, {"a": {"x": 1}, "b": {"x": 2}})
        store.save("gov", 7, {"a": None, "b": {"x": 3}})
        store.save("other", 1, {"a": {"y": 1}})
        store.save("gov", 9, {"c": encode_row({"x": [4]}), "b": None})  # rows as JSON text
        assert store.load("gov") == (9, {"c": {"x": [4]}})
        origin = Origin(log="GROVE made then", fold="1")
        store.set_origin("gov", origin, discard=False)
        assert store.origin("gov") == origin
        store.set_origin("gov", Origin(log="GROVE made later", fold="1"), discard=True)
        assert store.load("gov") == (0, {})
        assert store.load("other") == (1, {"a": {"y": 1}})
    finally:
        store.close()


def test_stores_made_at_once_on_an_empty_database_all_start(postgres: LocalPostgres) -> None:
    """Replicas, or every service on one database, starting together: each creates the
    tables it lacks, and a table another one made meanwhile is no failure."""
    failures: list[BaseException] = []
    for _ in range(5):
        url = postgres.database("together")
        together = threading.Barrier(6)

        def make(index: int, url: str = url, together: threading.Barrier = together) -> None:
            together.wait()
            try:
                store = ProjectionStore(url) if index % 2 else SessionStore(url)
                store.engine.dispose()
            except Exception as exc:  # noqa: BLE001 - every failure is reported below
                failures.append(exc)

        threads = [threading.Thread(target=make, args=(index,)) for index in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    assert failures == []


async def test_a_projection_in_postgresql_is_the_one_sqlite_keeps_and_resumes(
    event_log: EventLog, postgres: LocalPostgres, tmp_path: Path
) -> None:
    for parent in ("p1", "p2"):
        await event_log.append(spawn_event(parent))
        for index in range(3):
            child = spawn_event(f"{parent}-c{index}")
            await event_log.append(child.model_copy(update={"parent": parent}))
            await event_log.append(status_event(child.agent_id, "started"))
    in_postgres = Folded(event_log, postgres.database())
    in_sqlite = Folded(event_log, f"sqlite:///{tmp_path / 'p.db'}")
    try:
        await in_postgres.run()
        await in_sqlite.run()
        rows = in_postgres.store.load(in_postgres.name)
        assert rows == in_sqlite.store.load(in_sqlite.name)
        assert rows[0] == await event_log.last_seq()
        assert len(rows[1]) == 8

        runner, folded = await in_postgres.run()  # a restart resumes at the checkpoint
        assert (len(runner.state.agents), folded) == (8, [])
    finally:
        in_postgres.store.close()
        in_sqlite.store.close()


async def test_the_stack_runs_a_tree_and_resumes_on_postgresql(
    make_stack: StackFactory, event_log: EventLog, postgres: LocalPostgres
) -> None:
    url = postgres.database("stack")
    stack = await asyncio.to_thread(make_stack, GROVE_DATABASE_URL=url)
    client = GroveClient(event_log)
    parent = await client.spawn(
        "3", build_config("python", entrypoint="tests.agents:spawns_children")
    )
    ended = await wait_ended(event_log, [parent], timeout=60)
    assert ended[parent].result.summary == "completed,completed,completed"
    await asyncio.to_thread(stack.stop)
    tip = await event_log.last_seq()

    stored = stored_projections(url)
    # Once caught up, the artifact-store is sent only spawns, forks and artifacts: its
    # checkpoint is the last of those. The others follow the whole log.
    lasts = [await event_log.get_last(f"grove.{kind}.*") for kind in ("spawn", "fork", "artifact")]
    last_of_artifacts_kinds = max(record.seq for record in lasts if record is not None)
    assert {name: stored[name][0] for name in REBUILT} == {
        **dict.fromkeys(REBUILT, tip),
        "artifacts": last_of_artifacts_kinds,
    }
    nodes = [key for key in stored["router"][1] if key.startswith("node:")]
    assert len(nodes) == 4
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            sessions = conn.execute(
                select(func.count(func.distinct(entries_table.c.session_id)))
            ).scalar()
    finally:
        engine.dispose()
    assert sessions == 4  # the parent's and its three children's

    await asyncio.to_thread(stack.start)
    again = await client.spawn(
        "1", build_config("python", entrypoint="tests.agents:spawns_children")
    )
    ended = await wait_ended(event_log, [again], timeout=60)
    assert ended[again].result.summary == "completed"
    await asyncio.to_thread(stack.stop)
    assert stored_projections(url)["governor"][0] == await event_log.last_seq()


def stored_projections(url: str) -> dict[str, tuple[int, dict[str, Any]]]:
    store = ProjectionStore(url)
    try:
        return {name: store.load(name) for name in REBUILT}
    finally:
        store.close()

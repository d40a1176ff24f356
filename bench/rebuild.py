"""Projection rebuilds: each service's fold of a large log into an empty database."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from bench.stats import rate
from grove_artifacts import service as artifacts_service
from grove_artifacts.domain import ArtifactIndex
from grove_artifacts.domain import evolve as artifacts_evolve
from grove_core.log import EventLog
from grove_core.projection import ProjectionRunner, ProjectionStore
from grove_core.records import decode_record, is_deadletter
from grove_core.tasks import cancel_and_wait
from grove_governor.domain import FOLDED_KINDS as GOVERNOR_KINDS
from grove_governor.domain import GovernorState
from grove_governor.domain import evolve as governor_evolve
from grove_router.domain import RouterState
from grove_router.domain import evolve as router_evolve
from grove_spawner import service as spawner_service
from grove_spawner.domain import SpawnerState
from grove_spawner.domain import evolve as spawner_evolve

#: service -> (projection state, fold, kinds read), as each service's runner is set up.
PROJECTIONS: dict[str, tuple[type[Any], Any, frozenset[str] | None]] = {
    "governor": (GovernorState, governor_evolve, GOVERNOR_KINDS),
    "spawner": (SpawnerState, spawner_evolve, spawner_service.PROJECTION_KINDS),
    "router": (RouterState, router_evolve, None),
    "artifacts": (ArtifactIndex, artifacts_evolve, artifacts_service.PROJECTION_KINDS),
}


async def read_rate(log: EventLog, last_seq: int, *, decoded: bool) -> dict[str, Any]:
    """EventLog.read over the whole log (decoding each event when `decoded`), no fold."""
    count = 0
    started = time.perf_counter()
    async for raw in log.read(1, until_seq=last_seq):
        if decoded and not is_deadletter(raw.subject):
            decode_record(raw)
        count += 1
    elapsed = time.perf_counter() - started
    return {"events_per_s": rate(count, elapsed), "events": count, "seconds": round(elapsed, 3)}


def _empty_database(folder: Path, service: str) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    database = folder / f"rebuild-{service}.db"
    database.unlink(missing_ok=True)
    return f"sqlite:///{database}"


async def rebuild(
    log: EventLog, service: str, folder: Path, timeout: float = 900.0
) -> dict[str, Any]:
    """Time one service's ProjectionRunner from an empty SQLite database to caught up."""
    state_type, evolve, kinds = PROJECTIONS[service]
    store = ProjectionStore(_empty_database(folder, service))
    runner: ProjectionRunner[Any] = ProjectionRunner(
        name=service, log=log, store=store, state_type=state_type, evolve=evolve, kinds=kinds
    )
    last = await log.last_seq()
    started = time.perf_counter()
    task = asyncio.create_task(runner.run())
    try:
        await asyncio.wait_for(runner.caught_up.wait(), timeout)
        elapsed = time.perf_counter() - started
    finally:
        await cancel_and_wait(task)
        store.close()
    return {
        "events": last,
        "seconds": round(elapsed, 3),
        "events_per_s": rate(last, elapsed),
        "applied_seq": runner.applied_seq,
        # Whether the catch-up was read by a helper process (`grove_core.catchup`).
        "catch_up_helper": log.helper is not None and last >= log.helper.min_events,
    }

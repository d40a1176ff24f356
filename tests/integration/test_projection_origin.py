"""A stored projection is resumed only on the log and the fold that made it.

Against a real nats-server: a stream deleted and made again, a new version of the fold, or a
log that lost messages the projection had folded each make the runner delete its rows and
replay the log from sequence 1; a restart of the server, or a database stored before origins
were recorded, do not.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

from grove_core.log import EventLog
from grove_core.projection import Mark, Origin, ProjectionRunner, ProjectionStore
from grove_core.records import Recorded
from grove_core.tree import TreeState
from grove_core.tree import evolve as evolve_tree
from grove_events import new_id
from tests.conftest import NatsEndpoint
from tests.integration.test_log import fold_until_caught_up, spawn_event

pytestmark = pytest.mark.integration


def ignore_everything(state: TreeState, recorded: Recorded) -> TreeState:
    """A fold that keeps nothing (an older fold, for the version tests)."""
    return state


class Folded:
    """The runs of a projection against one database, and what each folded."""

    def __init__(self, event_log: EventLog, url: str) -> None:
        self.log = event_log
        self.store = ProjectionStore(url)
        self.name = f"origin-{new_id()}"

    async def run(self, **options: Any) -> tuple[ProjectionRunner[TreeState], list[int]]:
        """Run a runner until caught up, then stop it (its last write done); the runner and
        the sequences it folded."""
        folded: list[int] = []

        async def note(recorded: Recorded, live: bool) -> None:
            folded.append(recorded.seq)

        options.setdefault("evolve", evolve_tree)
        runner: ProjectionRunner[TreeState] = ProjectionRunner(
            name=self.name,
            log=self.log,
            store=self.store,
            state_type=TreeState,
            after_event=note,
            **options,
        )
        await fold_until_caught_up(runner)
        return runner, folded

    def rebuilds(self, cause: str) -> float:
        value = REGISTRY.get_sample_value(
            "grove_projection_rebuilds_total", {"projection": self.name, "cause": cause}
        )
        return value or 0.0


@pytest.fixture
def folded(event_log: EventLog, tmp_path: Path) -> Iterator[Folded]:
    runs = Folded(event_log, f"sqlite:///{tmp_path / 'projection.db'}")
    yield runs
    runs.store.close()


async def append_spawns(event_log: EventLog, *agents: str) -> None:
    for agent in agents:
        await event_log.append(spawn_event(agent))


async def test_a_projection_of_a_stream_made_again_is_rebuilt_from_the_new_one(
    event_log: EventLog, folded: Folded
) -> None:
    await append_spawns(event_log, "a", "b", "c")
    first, _ = await folded.run()
    assert set(first.state.agents) == {"a", "b", "c"}
    before, _ = await event_log.identity()

    await event_log.js.delete_stream(event_log.stream)
    await event_log.ensure_stream()
    await append_spawns(event_log, "d")  # sequence 1 of the new stream
    after, last_seq = await event_log.identity()
    assert (after != before, last_seq) == (True, 1)

    second, seqs = await folded.run()
    assert set(second.state.agents) == {"d"}
    assert (second.applied_seq, seqs) == (1, [1])
    assert folded.rebuilds("log") == 1
    assert folded.store.load(folded.name)[0] == 1
    assert folded.store.origin(folded.name) == Origin(log=after, fold="1")


async def test_a_new_version_of_the_fold_rebuilds_and_the_same_one_resumes(
    event_log: EventLog, folded: Folded
) -> None:
    await append_spawns(event_log, "a", "b")
    old, _ = await folded.run(evolve=ignore_everything)
    assert (old.applied_seq, old.state.agents) == (2, {})

    same, seqs = await folded.run(evolve=evolve_tree)  # the version was not bumped: resumed
    assert (same.state.agents, seqs) == ({}, [])

    await append_spawns(event_log, "c")
    new, seqs = await folded.run(evolve=evolve_tree, fold_version="2")
    assert set(new.state.agents) == {"a", "b", "c"}
    assert seqs == [1, 2, 3]
    assert folded.rebuilds("fold") == 1

    again, seqs = await folded.run(evolve=evolve_tree, fold_version="2")
    assert (set(again.state.agents), seqs) == ({"a", "b", "c"}, [])
    assert folded.rebuilds("fold") == 1


async def test_a_checkpoint_past_the_log_s_end_is_rebuilt(
    event_log: EventLog, folded: Folded
) -> None:
    """The log lost messages the projection had folded (say, a server without `sync_interval:
    always` lost its newest writes in a power cut): what comes next reuses their sequences."""
    await append_spawns(event_log, "a", "b")
    await folded.run()
    rows = folded.store.load(folded.name)[1]
    folded.store.save(folded.name, 5, {"gone": {**rows["a"], "agent_id": "gone"}})

    runner, seqs = await folded.run()
    assert set(runner.state.agents) == {"a", "b"}
    assert seqs == [1, 2]
    assert folded.rebuilds("checkpoint") == 1


async def test_a_checkpoint_whose_message_changed_is_rebuilt(
    event_log: EventLog, folded: Folded
) -> None:
    """The log lost messages the projection had folded, and took new ones at their sequences
    before the service started again: the log reaches the checkpoint, but the message there
    is not the one the projection folded."""
    await append_spawns(event_log, "a", "b", "c")
    await folded.run()
    mark = folded.store.mark(folded.name)
    assert mark is not None
    assert (mark.seq, mark.subject) == (3, "grove.spawn.c")
    found = await event_log.get_next(">", 3)
    assert found is not None
    assert Mark.of(found) == mark

    # As the projection would have stored it, had it folded a message since lost at seq 3.
    rows = folded.store.load(folded.name)[1]
    lost = Mark(3, "grove.spawn.lost", mark.stored_ms - 1)
    folded.store.save(folded.name, 3, {"lost": {**rows["a"], "agent_id": "lost"}}, lost)
    runner, seqs = await folded.run()
    assert set(runner.state.agents) == {"a", "b", "c"}
    assert seqs == [1, 2, 3]
    assert folded.rebuilds("checkpoint") == 1
    assert folded.store.mark(folded.name) == mark

    again, seqs = await folded.run()  # the mark holds: resumed
    assert (set(again.state.agents), seqs) == ({"a", "b", "c"}, [])
    assert folded.rebuilds("checkpoint") == 1


async def test_a_checkpoint_whose_message_the_stream_removed_is_resumed(
    event_log: EventLog, folded: Folded
) -> None:
    """Messages removed by the stream's limits or a purge cannot be compared; the sequences
    were not reused, so the projection is resumed."""
    await append_spawns(event_log, "a", "b")
    await folded.run()
    await event_log.js.purge_stream(event_log.stream, seq=3)  # removes seq 1 and 2
    await append_spawns(event_log, "c")
    runner, seqs = await folded.run()
    assert (set(runner.state.agents), seqs) == ({"a", "b", "c"}, [3])
    assert folded.rebuilds("checkpoint") == 0


async def test_a_database_stored_before_origins_is_resumed_and_given_one(
    event_log: EventLog, folded: Folded
) -> None:
    await append_spawns(event_log, "a", "b")
    await folded.run()
    stored = folded.store.load(folded.name)
    with folded.store.engine.begin() as conn:  # as a database of an earlier release
        conn.exec_driver_sql("DELETE FROM grove_projection_origins")
    assert folded.store.origin(folded.name) is None

    runner, seqs = await folded.run()
    assert (set(runner.state.agents), seqs) == ({"a", "b"}, [])
    assert folded.store.load(folded.name) == stored
    identity, _ = await event_log.identity()
    assert folded.store.origin(folded.name) == Origin(log=identity, fold="1")


@pytest.mark.local_nats
async def test_a_restarted_server_keeps_the_log_and_the_projection(
    nats_server: NatsEndpoint, tmp_path: Path
) -> None:
    event_log = await EventLog.connect(nats_server.url, name="origin-before")
    await event_log.ensure_stream()
    runs = Folded(event_log, f"sqlite:///{tmp_path / 'projection.db'}")
    try:
        await append_spawns(event_log, "a", "b")
        await runs.run()
        before = await event_log.identity()
    finally:
        await event_log.close()

    nats_server.kill()
    nats_server.restart()
    event_log = await EventLog.connect(nats_server.url, name="origin-after")
    runs.log = event_log
    try:
        await event_log.ensure_stream()  # as every start of the stack does
        assert await event_log.identity() == before
        runner, seqs = await runs.run()
        assert (set(runner.state.agents), seqs) == ({"a", "b"}, [])
        assert runs.rebuilds("log") == runs.rebuilds("checkpoint") == 0
    finally:
        await event_log.close()
        runs.store.close()

"""A long catch-up read by a helper process (`grove_core.catchup`), on a real nats-server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

from grove_core import catchup
from grove_core.catchup import CatchUpError, CatchUpHelper, read_in_helper
from grove_core.log import EventLog
from grove_core.projection import ProjectionRunner, ProjectionStore
from grove_core.records import RawRecord, Recorded
from grove_core.settings import NatsAccess
from grove_core.tasks import cancel_and_wait
from grove_core.tree import TreeState
from grove_core.tree import evolve as evolve_tree
from grove_events import AgentConfig, SpawnEvent, new_id
from tests.conftest import NatsEndpoint

pytestmark = pytest.mark.integration

#: More than two of the pipe's frames.
EVENTS = catchup.FRAME_RECORDS * 2 + 200


def spawn_event(agent_id: str) -> SpawnEvent:
    return SpawnEvent(
        event_id=new_id(),
        agent_id=agent_id,
        timestamp=datetime.now(UTC),
        task="catch up",
        config=AgentConfig(runtime="command", command=["true"]),
    )


async def append_spawns(event_log: EventLog, count: int, prefix: str) -> list[str]:
    agents = [f"{prefix}-{index}-{new_id()}" for index in range(count)]
    await event_log.append_many(spawn_event(agent) for agent in agents)
    return agents


async def collect(records: AsyncIterator[RawRecord]) -> list[RawRecord]:
    async with asyncio.timeout(30):
        return [record async for record in records]


class HelperSpy:
    """Notes each helper process `read_in_helper` starts (the real process runs)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.processes: list[asyncio.subprocess.Process] = []
        start = asyncio.create_subprocess_exec

        async def noted(*args: Any, **kwargs: Any) -> asyncio.subprocess.Process:
            process = await start(*args, **kwargs)
            self.processes.append(process)
            return process

        monkeypatch.setattr(catchup.asyncio, "create_subprocess_exec", noted)


@pytest.fixture
def helpers(monkeypatch: pytest.MonkeyPatch) -> Iterator[HelperSpy]:
    spy = HelperSpy(monkeypatch)
    yield spy
    for process in spy.processes:  # a test that failed leaves no helper behind
        if process.returncode is None:
            process.kill()


def tree_runner(
    name: str, event_log: EventLog, store: ProjectionStore, **options: Any
) -> ProjectionRunner[TreeState]:
    return ProjectionRunner(
        name=name, log=event_log, store=store, state_type=TreeState, evolve=evolve_tree, **options
    )


async def caught_up_rows(runner: ProjectionRunner[Any], store: ProjectionStore) -> dict[str, Any]:
    """Run `runner` until it has caught up; its stored checkpoint and rows."""
    running = asyncio.create_task(runner.run())
    try:
        await asyncio.wait_for(runner.caught_up.wait(), 30)
    finally:
        async with asyncio.timeout(10):  # at once, as a service stopped as it catches up
            await cancel_and_wait(running)
    seq, rows = store.load(runner.name)
    return {"seq": seq, "rows": rows}


async def test_a_helper_reads_exactly_what_the_log_reads(
    event_log: EventLog, nats_server: NatsEndpoint, helpers: HelperSpy
) -> None:
    await append_spawns(event_log, EVENTS, "same")
    last = await event_log.last_seq()
    access = NatsAccess(nats_server.url)

    for first, final in ((1, last), (321, 987)):
        helped = await collect(read_in_helper(access, event_log.stream, first, final))
        here = await collect(event_log.read(first, until_seq=final))
        assert [record.seq for record in helped] == list(range(first, final + 1))
        assert helped == here  # subjects, bodies, headers, stream times, pending: all alike
    assert len(helpers.processes) == 2
    assert [process.returncode for process in helpers.processes] == [0, 0]


async def test_a_slow_reader_holds_the_helper_back_not_the_log_in_memory(
    event_log: EventLog, nats_server: NatsEndpoint, helpers: HelperSpy
) -> None:
    count = 20_000  # about 7 MiB of records: several times what the pipe and reader hold
    await append_spawns(event_log, count, "slow")
    records = read_in_helper(NatsAccess(nats_server.url), event_log.stream, 1, count)
    try:
        first = await anext(records)
        await asyncio.sleep(2)  # the fold is slow: the helper could have sent it all by now
        assert helpers.processes[0].returncode is None  # it waits on the full pipe instead
        rest = await collect(records)
    finally:
        await records.aclose()
    assert [record.seq for record in [first, *rest]] == list(range(1, count + 1))
    assert helpers.processes[0].returncode == 0


async def test_a_projection_far_behind_catches_up_through_a_helper_to_the_same_state(
    event_log: EventLog, nats_server: NatsEndpoint, tmp_path: Path, helpers: HelperSpy
) -> None:
    agents = await append_spawns(event_log, EVENTS, "behind")
    folded_live = asyncio.Event()
    late = f"late-{new_id()}"

    async def note(recorded: Recorded, live: bool) -> None:
        if live and recorded.event.agent_id == late:
            folded_live.set()

    alone_store = ProjectionStore(f"sqlite:///{tmp_path / 'alone.db'}")
    alone = await caught_up_rows(tree_runner("tree", event_log, alone_store), alone_store)
    assert helpers.processes == []  # a log without a helper reads everything itself
    assert set(TreeState.from_rows(alone["rows"]).agents) == set(agents)

    event_log.helper = CatchUpHelper(NatsAccess(nats_server.url), min_events=EVENTS)
    helped_store = ProjectionStore(f"sqlite:///{tmp_path / 'helped.db'}")
    runner = tree_runner("tree", event_log, helped_store, catch_up_batch_size=300)
    assert await caught_up_rows(runner, helped_store) == alone
    assert len(helpers.processes) == 1

    # Caught up through a helper, a projection follows the log.
    store = ProjectionStore(f"sqlite:///{tmp_path / 'live.db'}")
    runner = tree_runner("tree", event_log, store, after_event=note)
    running = asyncio.create_task(runner.run())
    try:
        await asyncio.wait_for(runner.caught_up.wait(), 30)
        assert len(helpers.processes) == 2
        await event_log.append(spawn_event(late))
        await asyncio.wait_for(folded_live.wait(), 10)
    finally:
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running
    assert [process.returncode for process in helpers.processes] == [0, 0]
    assert late in runner.state.agents
    for each in (alone_store, helped_store, store):
        each.close()


async def test_a_projection_nearly_caught_up_reads_the_rest_itself(
    event_log: EventLog, nats_server: NatsEndpoint, tmp_path: Path, helpers: HelperSpy
) -> None:
    await append_spawns(event_log, 50, "near")
    event_log.helper = CatchUpHelper(NatsAccess(nats_server.url), min_events=51)
    store = ProjectionStore(f"sqlite:///{tmp_path / 'p.db'}")
    state = await caught_up_rows(tree_runner("near", event_log, store), store)
    assert state["seq"] == 50
    assert helpers.processes == []
    store.close()


def failures(name: str) -> float:
    value = REGISTRY.get_sample_value("grove_catch_up_helper_failures_total", {"projection": name})
    return value or 0.0


async def test_a_helper_killed_halfway_leaves_the_projection_to_read_on_itself(
    event_log: EventLog, nats_server: NatsEndpoint, tmp_path: Path, helpers: HelperSpy
) -> None:
    agents = await append_spawns(event_log, EVENTS, "killed")
    event_log.helper = CatchUpHelper(NatsAccess(nats_server.url), min_events=100)
    name = f"killed-{new_id()}"
    seen: list[int] = []

    async def kill_the_helper(recorded: Recorded, _live: bool) -> None:
        seen.append(recorded.seq)
        if recorded.seq == 300:  # in the helper's first frame
            helpers.processes[0].kill()

    store = ProjectionStore(f"sqlite:///{tmp_path / 'p.db'}")
    state = await caught_up_rows(
        tree_runner(name, event_log, store, after_event=kill_the_helper), store
    )
    assert helpers.processes[0].returncode is not None
    assert failures(name) == 1
    assert seen == list(range(1, EVENTS + 1))  # none lost, none twice
    assert state["seq"] == EVENTS
    assert set(TreeState.from_rows(state["rows"]).agents) == set(agents)
    store.close()


async def test_a_helper_that_cannot_connect_leaves_the_whole_catch_up_to_the_projection(
    event_log: EventLog, tmp_path: Path, helpers: HelperSpy
) -> None:
    agents = await append_spawns(event_log, 200, "unreachable")
    # A port nothing listens on (the helper gives up after its 10 s wait for a server).
    event_log.helper = CatchUpHelper(NatsAccess("nats://127.0.0.1:9"), min_events=100)
    name = f"unreachable-{new_id()}"
    store = ProjectionStore(f"sqlite:///{tmp_path / 'p.db'}")
    state = await caught_up_rows(tree_runner(name, event_log, store), store)
    assert helpers.processes[0].returncode == 1
    assert failures(name) == 1
    assert set(TreeState.from_rows(state["rows"]).agents) == set(agents)
    store.close()


async def test_a_stopped_projection_ends_its_helper(
    event_log: EventLog, nats_server: NatsEndpoint, tmp_path: Path, helpers: HelperSpy
) -> None:
    await append_spawns(event_log, EVENTS, "stopped")
    event_log.helper = CatchUpHelper(NatsAccess(nats_server.url), min_events=100)
    reached = asyncio.Event()

    async def note(recorded: Recorded, _live: bool) -> None:
        if recorded.seq == 100:
            reached.set()
            await asyncio.sleep(3600)  # the service is stopped while folding

    store = ProjectionStore(f"sqlite:///{tmp_path / 'p.db'}")
    running = asyncio.create_task(tree_runner("stopped", event_log, store, after_event=note).run())
    await asyncio.wait_for(reached.wait(), 30)
    running.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await running
    assert helpers.processes[0].returncode is not None  # ended and reaped
    store.close()


def start_helper(instructions: dict[str, Any]) -> subprocess.Popen[bytes]:
    helper = subprocess.Popen(
        [sys.executable, "-m", "grove_core.catchup"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert helper.stdin is not None
    helper.stdin.write(json.dumps(instructions).encode() + b"\n")
    helper.stdin.flush()
    return helper


async def test_a_helper_whose_reader_is_gone_exits(
    event_log: EventLog, nats_server: NatsEndpoint
) -> None:
    await append_spawns(event_log, EVENTS, "orphan")
    reading = {"access": {"url": nats_server.url}, "stream": event_log.stream, "name": "orphan"}
    # Waiting for a server that is not there: it notices that its input closed.
    waiting = start_helper(
        {**reading, "access": {"url": "nats://127.0.0.1:9"}, "from_seq": 1, "until_seq": 10}
    )
    # Blocked on a full pipe: it notices that nobody reads any more.
    blocked = start_helper({**reading, "from_seq": 1, "until_seq": EVENTS})
    try:
        assert blocked.stdout is not None
        assert int.from_bytes(blocked.stdout.read(4), "big") > 0  # it sends
        for helper in (waiting, blocked):
            assert helper.stdin is not None
            assert helper.stdout is not None
            helper.stdin.close()
            helper.stdout.close()
        assert await asyncio.to_thread(waiting.wait, 5) == 1
        assert await asyncio.to_thread(blocked.wait, 5) == 1
    finally:
        for helper in (waiting, blocked):
            if helper.poll() is None:
                helper.kill()
                helper.wait()


@pytest.mark.local_nats
async def test_a_helper_whose_reader_goes_while_the_server_is_silent_exits(
    event_log: EventLog, nats_server: NatsEndpoint
) -> None:
    await append_spawns(event_log, EVENTS, "silent")
    helper = start_helper(
        {
            "access": {"url": nats_server.url},
            "stream": event_log.stream,
            "name": "silent",
            "from_seq": 1,
            "until_seq": EVENTS,
        }
    )
    try:
        assert helper.stdout is not None
        assert helper.stdin is not None
        assert int.from_bytes(helper.stdout.read(4), "big") > 0  # blocked on the full pipe
        with nats_server.silent():
            helper.stdin.close()
            helper.stdout.close()
            # Nothing it could wait for from the server keeps it: no helper outlives its reader.
            assert await asyncio.to_thread(helper.wait, catchup.STOP_WITHIN + 3) == 1
    finally:
        if helper.poll() is None:
            helper.kill()
            helper.wait()


@pytest.mark.local_nats
async def test_a_reader_closes_without_waiting_for_a_silent_server(
    nats_server: NatsEndpoint, event_log: EventLog
) -> None:
    await append_spawns(event_log, 10, "closing")
    reader = await EventLog.connect(nats_server.url, name="closing")
    records = reader.read(1, follow=True)
    assert (await anext(records)).seq == 1  # a live subscription
    loop = asyncio.get_running_loop()
    with nats_server.silent():
        started = loop.time()
        await reader.close(drain=False)
        took = loop.time() - started
    await records.aclose()
    # A drain would wait for the server's answer: nats-py's flush timeout, 10 s.
    assert took < 5.0
    assert reader.nc.is_closed


@pytest.mark.parametrize("given", ["an empty pipe", "no pipe"])
def test_a_helper_told_nothing_exits_at_once(given: str) -> None:
    helper = subprocess.Popen(
        [sys.executable, "-m", "grove_core.catchup"],
        stdin=subprocess.PIPE if given == "an empty pipe" else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    _, errors = helper.communicate(timeout=10)
    assert helper.returncode == 2
    if given == "no pipe":
        assert b"reads its instructions from a pipe" in errors


async def test_a_helper_stopping_early_is_told_as_such(nats_server: NatsEndpoint) -> None:
    # A stream that does not exist: the helper fails, and the reader says so.
    with pytest.raises(CatchUpError, match="stopped early"):
        await collect(read_in_helper(NatsAccess(nats_server.url), "NO_SUCH_STREAM", 1, 5))


async def test_a_helper_that_dies_at_once_is_told_as_such(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    start = asyncio.create_subprocess_exec

    async def dies_at_once(*_: Any, **kwargs: Any) -> asyncio.subprocess.Process:
        # A helper that cannot even start (say, a broken install): a process that exits at once.
        return await start(sys.executable, "-c", "import sys; sys.exit(3)", **kwargs)

    monkeypatch.setattr(catchup.asyncio, "create_subprocess_exec", dies_at_once)
    with pytest.raises(CatchUpError, match=r"exit code 3"):
        await collect(read_in_helper(NatsAccess("nats://127.0.0.1:9"), "GROVE", 1, 5))

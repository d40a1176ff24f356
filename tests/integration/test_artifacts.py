"""The artifact-store against a real nats-server: dedup, scoping, limits, delete, large
artifacts, a rebuild from the log, the CLI, and the return contract on a running stack."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import random
import re
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from agentgrove import GroveClient, build_config
from agentgrove.artifacts import ArtifactError, Artifacts
from agentgrove.stack import Stack
from grove_artifacts.blobs import BlobStore
from grove_artifacts.service import UPLOAD_IDLE_S, ArtifactStore
from grove_core.config import ArtifactLimits
from grove_core.log import EventLog
from grove_core.projection import ProjectionStore
from grove_core.records import Recorded
from grove_events import ArtifactEvent, ForkEvent, SpawnEvent, StatusEvent, new_id
from tests.conftest import NatsEndpoint, StackFactory

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]

COMMAND = build_config("command", command=["true"])


class RunningStore:
    """An artifact-store in this process, on its own connection (as its own process would be)."""

    def __init__(self, url: str, folder: Path, limits: ArtifactLimits) -> None:
        self.url = url
        self.folder = folder
        self.limits = limits
        self.log: EventLog | None = None
        self.store: ArtifactStore | None = None
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> ArtifactStore:
        self.log = await EventLog.connect(self.url, name="artifacts-under-test")
        staging = self.folder / "uploads"
        staging.mkdir(parents=True, exist_ok=True)
        blobs = await BlobStore.open(self.log.js, max_bytes=self.limits.max_store_bytes)
        database = ProjectionStore(f"sqlite:///{self.folder / 'artifacts.db'}")
        self.store = ArtifactStore(self.log, database, blobs, self.limits, staging)
        self.task = asyncio.create_task(self.store.runner.run())
        await asyncio.wait_for(self.store.runner.caught_up.wait(), 20)
        await self.store.sweep()
        await self.store.rpc.start(self.url)
        return self.store

    async def stop(self) -> None:
        if self.store is not None:
            await self.store.rpc.close()
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        if self.store is not None:
            self.store.runner.store.close()
        if self.log is not None:
            await self.log.close()


StartStore = Callable[..., Awaitable[RunningStore]]


@pytest.fixture
async def start_store(
    nats_server: NatsEndpoint, event_log: EventLog, tmp_path: Path
) -> AsyncIterator[StartStore]:
    running: list[RunningStore] = []

    async def start(**limits: int) -> RunningStore:
        store = RunningStore(nats_server.url, tmp_path / "artifacts", ArtifactLimits(**limits))
        running.append(store)
        await store.start()
        return store

    try:
        yield start
    finally:
        for store in running:
            await store.stop()


async def spawn(log: EventLog, agent_id: str, parent: str | None = None) -> int:
    appended = await log.append(
        SpawnEvent(event_id=new_id(), agent_id=agent_id, parent=parent, task="t", config=COMMAND)
    )
    return appended.seq


async def fork(log: EventLog, agent_id: str, source: str) -> int:
    appended = await log.append(
        ForkEvent(event_id=new_id(), agent_id=agent_id, source_agent=source, reason="try")
    )
    return appended.seq


async def test_a_put_after_an_agent_s_status_is_answered_though_the_index_never_sees_it(
    event_log: EventLog, start_store: StartStore
) -> None:
    running = await start_store()
    assert running.store is not None
    await spawn(event_log, "worker")
    # The spawner stores an agent's result after its `started` status. Once caught up, the
    # index is sent spawns, forks and artifacts only, so it never folds that status.
    started = await event_log.append(
        StatusEvent(event_id=new_id(), agent_id="worker", status_type="started")
    )
    stored = await Artifacts(event_log, agent_id="worker").put(
        b"the result", name="result.txt", after_seq=started.seq
    )
    assert stored.tree_id == "worker"
    assert running.store.runner.applied_seq == started.seq + 1  # the artifact, not the status


async def test_two_puts_of_the_same_bytes_are_two_artifacts_and_one_blob(
    event_log: EventLog, start_store: StartStore
) -> None:
    running = await start_store()
    assert running.store is not None
    await spawn(event_log, "root")
    seq = await spawn(event_log, "kid", parent="root")
    artifacts = Artifacts(event_log, agent_id="kid")
    first = await artifacts.put(b"same bytes", name="a.bin", after_seq=seq)
    second = await Artifacts(event_log, agent_id="root").put(b"same bytes", name="b.bin")
    assert first.artifact_id != second.artifact_id
    assert first.sha256 == second.sha256 == hashlib.sha256(b"same bytes").hexdigest()
    assert (first.tree_id, second.tree_id) == ("root", "root")
    assert await running.store.blobs.names() == [first.sha256]
    listed = await artifacts.list()
    assert [a.name for a in listed] == ["a.bin", "b.bin"]
    assert running.store.state.tree_bytes["root"] == 20
    assert running.store.state.blob_bytes == 10
    # Every put is an `artifact` event on the log, about the agent that put it.
    async with asyncio.timeout(10):
        recorded = [
            item.event
            async for item in event_log.events(1, subjects="grove.artifact.*")
            if isinstance(item, Recorded) and isinstance(item.event, ArtifactEvent)
        ]
    assert [(e.agent_id, e.artifact_id, e.name, e.size, e.sha256) for e in recorded] == [
        ("kid", first.artifact_id, "a.bin", 10, first.sha256),
        ("root", second.artifact_id, "b.bin", 10, second.sha256),
    ]

    deleted = await artifacts.delete(first.artifact_id)
    assert deleted.artifact_id == first.artifact_id
    assert await running.store.blobs.names() == [first.sha256], "the other artifact uses it"
    assert await artifacts.get(second.artifact_id) == b"same bytes"
    with pytest.raises(ArtifactError, match="was deleted by kid"):
        await artifacts.get(first.artifact_id)
    await artifacts.delete(second.artifact_id)
    assert await running.store.blobs.names() == []
    assert await artifacts.list() == []


async def test_an_agent_sees_only_its_own_tree(
    event_log: EventLog, start_store: StartStore
) -> None:
    await start_store()
    await spawn(event_log, "tree-a")
    await spawn(event_log, "a-kid", parent="tree-a")
    await fork(event_log, "a-fork", source="a-kid")
    seq = await spawn(event_log, "tree-b")
    mine = await Artifacts(event_log, agent_id="a-kid").put(
        "notes of a", name="notes.txt", after_seq=seq
    )
    assert mine.media_type.startswith("text/plain")
    theirs = await Artifacts(event_log, agent_id="tree-b").put(b"b", name="b.bin")

    outsider = Artifacts(event_log, agent_id="tree-b")
    with pytest.raises(ArtifactError, match="belongs to another tree"):
        await outsider.get(mine.artifact_id)
    with pytest.raises(ArtifactError, match="belongs to another tree"):
        await outsider.delete(mine.artifact_id)
    assert [a.artifact_id for a in await outsider.list()] == [theirs.artifact_id]

    assert await Artifacts(event_log, agent_id="a-fork").get(mine.artifact_id) == b"notes of a"
    assert [a.artifact_id for a in await Artifacts(event_log, agent_id="tree-a").list()] == [
        mine.artifact_id
    ]
    operator = Artifacts(event_log)
    assert await operator.get(theirs.artifact_id) == b"b"
    assert len(await operator.list()) == 2
    named = Artifacts(event_log, tree_id="tree-b")
    with pytest.raises(ArtifactError, match="belongs to another tree"):
        await named.get(mine.artifact_id)
    with pytest.raises(ArtifactError, match="no agent 'nobody' in the log"):
        await Artifacts(event_log, agent_id="nobody").put(b"x", name="x")
    with pytest.raises(ArtifactError, match="no artifact 'missing'"):
        await operator.get("missing")


async def test_limits_per_artifact_and_per_tree_are_refused_clearly(
    event_log: EventLog, start_store: StartStore
) -> None:
    running = await start_store(max_artifact_bytes=1000, max_tree_bytes=1500)
    assert running.store is not None
    await spawn(event_log, "small")
    seq = await spawn(event_log, "other")
    small = Artifacts(event_log, agent_id="small")
    refused_before = {reason: refusals(reason) for reason in ("too_large", "tree_full")}
    with pytest.raises(
        ArtifactError, match=r"1001 bytes is over artifacts.max_artifact_bytes=1000"
    ):
        await small.put(b"x" * 1001, name="big", after_seq=seq)
    kept = await small.put(b"y" * 800, name="one")
    with pytest.raises(ArtifactError, match=r"tree small holds 800 bytes.*max_tree_bytes=1500"):
        await small.put(b"z" * 800, name="two")
    await Artifacts(event_log, agent_id="other").put(b"z" * 800, name="theirs")
    await small.delete(kept.artifact_id)
    await small.put(b"z" * 800, name="two")
    with pytest.raises(ArtifactError, match="hash to sha256"):
        await small.rpc(
            "put", {"agent_id": "small", "name": "n", "size": 1, "sha256": "0" * 64, "data": "eA=="}
        )
    assert running.store.reserved == {}, "refused and finished puts reserve nothing"
    assert refusals("too_large") == refused_before["too_large"] + 1
    assert refusals("tree_full") == refused_before["tree_full"] + 1

    racing = Artifacts(event_log, agent_id="other")
    outcomes = await asyncio.gather(
        *(racing.put(bytes([i]) * 400, name=f"race-{i}") for i in range(4)),
        return_exceptions=True,
    )
    stored = [o for o in outcomes if not isinstance(o, BaseException)]
    assert len(stored) == 1, "800 + 400 fit in 1500, a second 400 does not"
    assert all("max_tree_bytes" in str(o) for o in outcomes if isinstance(o, BaseException))
    assert running.store.state.tree_bytes["other"] == 1200


def refusals(reason: str) -> float:
    value = REGISTRY.get_sample_value("grove_artifact_requests_refused_total", {"reason": reason})
    return value or 0.0


async def test_a_retried_put_is_stored_once(event_log: EventLog, start_store: StartStore) -> None:
    running = await start_store()
    assert running.store is not None
    seq = await spawn(event_log, "root")
    artifacts = Artifacts(event_log, agent_id="root")
    put_id = new_id()
    first = await artifacts.put(b"once", name="a.txt", after_seq=seq, put_id=put_id)
    again = await artifacts.put(b"once", name="a.txt", put_id=put_id)
    assert first.artifact_id == again.artifact_id == put_id
    # Two attempts at once (the first's answer lost, say): the log keeps one put.
    racing = new_id()
    both = await asyncio.gather(
        *(artifacts.put(b"x" * 700_000, name="big.bin", put_id=racing) for _ in range(2))
    )
    assert {a.artifact_id for a in both} == {racing}
    retried = await artifacts.put(b"x" * 700_000, name="big.bin", put_id=racing)  # chunked
    assert retried.artifact_id == racing
    assert sorted(a.name for a in await artifacts.list()) == ["a.txt", "big.bin"]
    assert running.store.state.tree_bytes["root"] == 4 + 700_000

    await artifacts.delete(put_id)
    with pytest.raises(ArtifactError, match="deleted since; put again with a new id"):
        await artifacts.put(b"once", name="a.txt", put_id=put_id)


async def test_a_full_object_store_refuses_a_put_clearly_and_keeps_nothing_of_it(
    event_log: EventLog, start_store: StartStore
) -> None:
    running = await start_store(max_store_bytes=700_000)
    assert running.store is not None
    seq = await spawn(event_log, "root")
    artifacts = Artifacts(event_log, agent_id="root")
    kept = await artifacts.put(os.urandom(400_000), name="first.bin", after_seq=seq)
    before = refusals("store_full")

    with pytest.raises(ArtifactError, match="the artifact store is full") as refused:
        await artifacts.put(os.urandom(400_000), name="second.bin")
    assert "retry once artifacts are deleted" in str(refused.value)
    assert refusals("store_full") == before + 1
    assert [a.name for a in await artifacts.list()] == ["first.bin"]
    assert await running.store.blobs.names() == [kept.sha256]
    bucket = await event_log.js.stream_info(running.store.blobs.stream)
    assert bucket.state.bytes < 500_000, "chunks of the refused blob were left behind"

    # Space freed, the same put goes through; the store never stopped answering.
    await artifacts.delete(kept.artifact_id)
    data = os.urandom(400_000)
    stored = await artifacts.put(data, name="second.bin")
    assert await artifacts.get(stored.artifact_id) == data


async def test_an_upload_must_add_up_to_what_its_put_declared(
    event_log: EventLog, start_store: StartStore
) -> None:
    running = await start_store()
    assert running.store is not None
    seq = await spawn(event_log, "uploader")
    store = Artifacts(event_log, agent_id="uploader")
    with pytest.raises(ArtifactError, match="got 1 of the 2 bytes"):
        await store.rpc(
            "put",
            {"agent_id": "uploader", "name": "n", "size": 2, "data": "eA==", "after_seq": seq},
        )
    opened = await store.rpc("put", {"agent_id": "uploader", "name": "n", "size": 6})
    upload = opened["upload_id"]
    assert opened["chunk_bytes"] >= 128 * 1024
    with pytest.raises(ArtifactError, match="must start at offset 0, not 5"):
        await store.rpc("put_chunk", {"upload_id": upload, "offset": 5, "data": "eHh4"})
    assert (await store.rpc("put_chunk", {"upload_id": upload, "offset": 0, "data": "eHh4"}))[
        "received"
    ] == 3
    with pytest.raises(ArtifactError, match="more than the 6 bytes"):
        await store.rpc("put_chunk", {"upload_id": upload, "offset": 3, "data": "eHh4eHh4"})
    with pytest.raises(ArtifactError, match="got 3 of the 6 bytes"):
        await store.rpc("put_commit", {"upload_id": upload})
    with pytest.raises(ArtifactError, match=r"no upload .* in progress"):
        await store.rpc("put_commit", {"upload_id": upload})
    with pytest.raises(ArtifactError, match="needs the previous answer's 'cursor'"):
        await store.rpc("get", {"artifact_id": "whatever", "offset": 10})
    assert running.store.reserved == {}
    assert await running.store.blobs.names() == []

    idle = await store.rpc("put", {"agent_id": "uploader", "name": "n", "size": 100})
    assert running.store.reserved == {"uploader": 100}
    assert running.store.drop_idle(time.monotonic()) == 0
    assert running.store.drop_idle(time.monotonic() + UPLOAD_IDLE_S + 1) == 1
    assert running.store.reserved == {}
    with pytest.raises(ArtifactError, match=r"dropped after 60s idle"):
        await store.rpc("put_chunk", {"upload_id": idle["upload_id"], "offset": 0, "data": "eA=="})


async def test_a_multi_megabyte_artifact_survives_a_restart_without_its_database(
    nats_server: NatsEndpoint, event_log: EventLog, start_store: StartStore
) -> None:
    running = await start_store()
    seq = await spawn(event_log, "big")
    payload = random.Random(7).randbytes(5 * 1024 * 1024 + 123)
    artifacts = Artifacts(event_log, agent_id="big")
    stored = await artifacts.put(
        payload, name="big.bin", media_type="application/x-test", after_seq=seq
    )
    assert stored.size == len(payload)
    assert await artifacts.get(stored.artifact_id) == payload

    await running.stop()
    (running.folder / "artifacts.db").unlink()
    orphan = b"written, but its put never reached the log"
    blobs = await BlobStore.open(event_log.js)
    await blobs.put(hashlib.sha256(orphan).hexdigest(), io.BytesIO(orphan))
    again = await start_store()
    assert again.store is not None
    assert await again.store.blobs.names() == [stored.sha256], "the orphan blob is swept"
    assert again.store.state.tree_bytes["big"] == len(payload)
    artifact, data = await artifacts.read(stored.artifact_id)
    assert artifact == stored
    assert data == payload


async def test_the_cli_puts_lists_gets_and_removes(
    nats_server: NatsEndpoint, event_log: EventLog, start_store: StartStore, tmp_path: Path
) -> None:
    await start_store()
    await spawn(event_log, "cli-root")
    await spawn(event_log, "cli-kid", parent="cli-root")
    source = tmp_path / "report.md"
    source.write_text("# report\n" + "line\n" * 50_000)

    async def grove(*args: str) -> tuple[int, str, str]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "agentgrove.cli",
            *args,
            "--nats-url",
            nats_server.url,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "GROVE_DATA_DIR": str(tmp_path / "none")},
        )
        out, err = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode is not None
        return proc.returncode, out.decode(), err.decode()

    code, out, err = await grove(
        "artifacts", "put", str(source), "--agent", "cli-kid", "--media-type", "text/markdown"
    )
    assert (code, err) == (0, "")
    artifact_id = out.strip()
    code, out, _ = await grove("artifacts", "ls", "--tree", "cli-root")
    assert code == 0
    assert artifact_id in out
    assert "report.md" in out
    code, out, _ = await grove("artifacts", "ls", "--agent", "cli-kid", "--json")
    assert code == 0
    [listed] = json.loads(out)
    assert (listed["artifact_id"], listed["media_type"], listed["size"]) == (
        artifact_id,
        "text/markdown",
        source.stat().st_size,
    )
    code, out, _ = await grove("artifacts", "ls", "--tree", "elsewhere")
    assert (code, out.strip()) == (0, "(no artifacts)")
    copy = tmp_path / "copy.md"
    code, _, _ = await grove("artifacts", "get", artifact_id, "-o", str(copy))
    assert code == 0
    assert copy.read_bytes() == source.read_bytes()
    code, _, err = await grove("artifacts", "rm", artifact_id, "--agent", "cli-kid")
    assert code == 0
    code, out, err = await grove("artifacts", "get", artifact_id)
    assert code == 1
    assert err.startswith("grove: error:")
    assert "was deleted" in err
    assert len(err.strip().splitlines()) == 1


async def test_an_over_budget_result_is_stored_whole_and_its_handle_returned(
    make_stack: StackFactory, nats_server: NatsEndpoint
) -> None:
    stack = make_stack()
    async with await GroveClient.connect(nats_server.url) as client:
        parent = await client.spawn(
            "100000", build_config("python", entrypoint="tests.artifact_agents:reads_child_result")
        )
        result = await client.wait(parent, timeout=60)
        assert result.reason == "completed", result.error
        child_id, length, digest = result.summary.split()
        expected = "".join(chr(ord("a") + i % 26) for i in range(100_000))
        assert (int(length), digest) == (100_000, hashlib.sha256(expected.encode()).hexdigest())

        child = await client.wait(child_id, timeout=10)
        assert child.reason == "completed"
        assert child.truncated
        assert len(child.summary) == 6000
        assert child.summary == expected[:6000]
        assert child.artifact is not None
        assert await client.artifacts.get_text(child.artifact) == expected
        listed = await Artifacts(client.log, agent_id=parent).list(owner=child_id)
        assert [a.artifact_id for a in listed] == [child.artifact]

    metrics = await asyncio.to_thread(scrape, stack.services["artifacts"].http_port)
    assert "grove_artifact_bytes 100000.0" in metrics
    assert "grove_artifacts 1.0" in metrics

    stack.services["artifacts"].kill()
    for database in stack.data_dir.glob("artifacts.db*"):
        database.unlink()
    await asyncio.to_thread(stack.restart, "artifacts")
    async with await GroveClient.connect(nats_server.url) as client:
        assert await client.artifacts.get_text(child.artifact) == expected


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return str(response.read().decode())


async def test_a_silent_artifact_store_does_not_hold_back_the_terminate(
    make_stack: StackFactory, nats_server: NatsEndpoint
) -> None:
    stack = make_stack(GROVE_RESULT_STORE_TIMEOUT="2")
    stack.services["artifacts"].kill()
    async with await GroveClient.connect(nats_server.url) as client:
        agent = await client.spawn(
            "9000",
            build_config(
                "python", entrypoint="tests.artifact_agents:long_result", return_budget=100
            ),
        )
        result = await client.wait(agent, timeout=60)
    assert result.reason == "completed"
    assert result.truncated
    assert result.artifact is None
    assert len(result.summary) == 100
    assert "the full result (9000 characters) could not be stored" in (result.error or "")


@pytest.fixture
def secured_stack(tmp_path: Path) -> Iterator[Stack]:
    stack = Stack(tmp_path / "grove", auth=True, extra_env={"PYTHONPATH": str(ROOT)})
    try:
        yield stack.start()
    finally:
        stack.stop()


async def test_artifacts_work_under_the_deployed_permissions(secured_stack: Stack) -> None:
    async with await GroveClient.connect(secured_stack.caller_url) as client:
        agent = await client.spawn(
            "7000", build_config("python", entrypoint="tests.artifact_agents:long_result")
        )
        result = await client.wait(agent, timeout=30)
        assert result.artifact is not None, result.error
        assert len(await client.artifacts.get(result.artifact)) == 7000
        payload = random.Random(3).randbytes(1_500_000)
        stored = await Artifacts(client.log, agent_id=agent).put(payload, name="big.bin")
        assert await client.artifacts.get(stored.artifact_id) == payload


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("../../etc/passwd", "'..' segment"),
        ("notes/../../../outside.txt", "'..' segment"),
        ("/etc/passwd", "must be a relative path"),
        ("reports//week.md", "empty, '.' or '..' segment"),
        ("..\\windows\\system.ini", "backslashes"),
        ("nul\x00byte.txt", "control characters"),
        ("x" * 513, "at most 512 characters"),
    ],
)
async def test_a_name_with_path_tricks_is_refused_and_counted(
    event_log: EventLog, start_store: StartStore, name: str, reason: str
) -> None:
    running = await start_store()
    assert running.store is not None
    seq = await spawn(event_log, "tricky")
    tricky = Artifacts(event_log, agent_id="tricky")
    before = refusals("bad_request")
    with pytest.raises(ArtifactError, match=re.escape(reason)):
        await tricky.put(b"contents", name=name, after_seq=seq)
    assert refusals("bad_request") == before + 1
    assert await tricky.list() == []
    kept = await tricky.put(b"contents", name="reports/week-1.md")
    assert [a.name for a in await tricky.list()] == [kept.name]

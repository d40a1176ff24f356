"""The spawner's lifecycle against a real nats-server and the services as processes.

Resume on the same session, fork from a copy of the source's session, the failure report,
pause and resume of everything, an end decided elsewhere, a stop a run does not heed at once,
exactly one start with two spawners,
a lost spawner's agents, the completion a silent agent is given, and admissions answered from
the spawner's own projection.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from agentgrove.client import GroveClient, UnknownAgent, build_config
from agentgrove.stack import Stack
from grove_core.log import EventLog
from grove_core.records import Recorded
from grove_events import (
    AgentConfig,
    ControlEvent,
    StatusEvent,
    TerminateEvent,
    new_id,
    subject_for,
)
from grove_spawner.sessions import fork_context_message

pytestmark = pytest.mark.integration

StackFactory = Callable[..., Stack]


def python_agent(function: str) -> AgentConfig:
    return build_config("python", entrypoint=f"tests.lifecycle_agents:{function}")


def ticking(path: Path) -> AgentConfig:
    """A command that appends a line to `path` every 50 ms until it is ended."""
    loop = 'while :; do echo tick >> "$0"; sleep 0.05; done'
    return build_config("command", command=["sh", "-c", loop, str(path)])


async def events(event_log: EventLog) -> list[Recorded]:
    """Every valid event, by a replay to the current tip."""
    return [item async for item in event_log.events(1) if isinstance(item, Recorded)]


def of(
    records: list[Recorded], agent_id: str, kind: str, status_type: str | None = None
) -> list[Any]:
    return [
        r.event
        for r in records
        if r.event.agent_id == agent_id
        and r.event.type == kind
        and (status_type is None or getattr(r.event, "status_type", None) == status_type)
    ]


async def wait_for(
    event_log: EventLog,
    subject: str,
    matches: Callable[[Any], bool] = lambda _: True,
    timeout: float = 20,
    count: int = 1,
) -> list[Any]:
    """The first `count` events on `subject` that match, waiting for them."""
    found: list[Any] = []
    async with asyncio.timeout(timeout):
        async for item in event_log.events(1, subjects=subject, follow=True):
            if isinstance(item, Recorded) and matches(item.event):
                found.append(item.event)
                if len(found) == count:
                    return found
    return found


def status_is(status_type: str, summary: str | None = None) -> Callable[[Any], bool]:
    def matches(event: Any) -> bool:
        return (
            isinstance(event, StatusEvent)
            and event.status_type == status_type
            and (summary is None or event.payload.summary == summary)
        )

    return matches


async def wait_status(
    event_log: EventLog, agent_id: str, status_type: str, timeout: float = 20, **kw: Any
) -> StatusEvent:
    (event,) = await wait_for(
        event_log, subject_for("status", agent_id), status_is(status_type, **kw), timeout
    )
    assert isinstance(event, StatusEvent)
    return event


async def wait_ends(
    event_log: EventLog, agent_id: str, count: int = 1, timeout: float = 20
) -> list[TerminateEvent]:
    return await wait_for(
        event_log, subject_for("terminate", agent_id), timeout=timeout, count=count
    )


def size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


async def grows(path: Path, seconds: float) -> bool:
    """Whether the file grows within `seconds`."""
    before = size(path)
    await asyncio.sleep(seconds)
    return size(path) > before


async def control(event_log: EventLog, action: str, agent_id: str = "operator") -> None:
    await event_log.append(
        ControlEvent(
            event_id=new_id(),
            agent_id=agent_id,
            timestamp=datetime.now(UTC),
            action=action,  # type: ignore[arg-type]
            reason="load test",
        )
    )


# -- resume and fork (need the governor to admit them) ---------------------------------------------


async def test_a_stopped_agent_resumes_with_its_history_and_the_message(
    make_stack: StackFactory, event_log: EventLog
) -> None:
    await asyncio.to_thread(make_stack)
    client = GroveClient(event_log)
    agent = await client.spawn("remember this", python_agent("remembers"))
    await wait_status(event_log, agent, "checkpoint", summary="recorded")
    await client.stop(agent, "pause for a while")
    (stopped,) = await wait_ends(event_log, agent)
    assert stopped.reason == "stopped"

    await client.resume(agent, "please go on")
    ends = await wait_ends(event_log, agent, count=2, timeout=30)

    assert ends[1].reason == "completed", ends[1].error
    seen = json.loads(ends[1].result.summary)
    assert seen["start"] == "resume"
    assert seen["message"] == "please go on"
    assert seen["session_id"] == agent
    assert seen["history"] == [
        ["user", "remember this"],
        ["assistant", "step 1"],
        ["tool_call", "look around"],
        ["tool_result", "found a clue"],
        ["user", "please go on"],
        ["assistant", "went on"],
    ]
    started = of(await events(event_log), agent, "status", "started")
    assert [s.payload.details["start"] for s in started] == ["spawn", "resume"]
    assert {s.session_id for s in started} == {agent}
    with pytest.raises(UnknownAgent):
        await client.resume(new_id(), "hello?")


async def test_a_fork_starts_from_a_copy_of_the_session_and_the_source_goes_on(
    make_stack: StackFactory, event_log: EventLog
) -> None:
    await asyncio.to_thread(make_stack)
    client = GroveClient(event_log)
    source = await client.spawn("remember this", python_agent("remembers"))
    await wait_status(event_log, source, "checkpoint", summary="recorded")

    fork = await client.fork(source, "try the back door", initial_message="look behind the house")
    (ended,) = await wait_ends(event_log, fork, timeout=30)

    assert ended.reason == "completed", ended.error
    seen = json.loads(ended.result.summary)
    assert (seen["start"], seen["fork_of"], seen["session_id"]) == ("fork", source, fork)
    assert seen["history"] == [
        ["user", "remember this"],
        ["assistant", "step 1"],
        ["tool_call", "look around"],
        ["tool_result", "found a clue"],
        ["system", fork_context_message(source, "try the back door")],
        ["user", "look behind the house"],
        ["assistant", "went on"],
    ]
    records = await events(event_log)
    (fork_started,) = of(records, fork, "status", "started")
    assert fork_started.tree_id == source
    assert fork_started.payload.details["fork_of"] == source
    assert of(records, source, "terminate") == []
    assert len(of(records, source, "status", "started")) == 1
    assert (await event_log.get_last(subject_for("terminate", source))) is None
    with pytest.raises(UnknownAgent):
        await client.fork(new_id(), "no such agent")
    await client.stop(source)
    (source_end,) = await wait_ends(event_log, source)
    assert source_end.reason == "stopped"


# -- failure, pause, an end from elsewhere --------------------------------------------------------


async def test_a_failure_is_reported_with_what_was_attempted_and_not_retried(
    make_stack: StackFactory, event_log: EventLog
) -> None:
    await asyncio.to_thread(make_stack)
    client = GroveClient(event_log)
    agent = await client.spawn("open the door", python_agent("fails"))

    (ended,) = await wait_ends(event_log, agent)
    await asyncio.sleep(1.0)  # a retry, had there been one, would have started by now

    assert ended.reason == "failed"
    assert ended.error == "RuntimeError: the door is locked"
    records = await events(event_log)
    (failed,) = of(records, agent, "status", "failed")
    assert failed.payload.details == {
        "error": "RuntimeError: the door is locked",
        "attempted": ["tried the front door"],
        "partial_results": ["half a map"],
    }
    assert len(of(records, agent, "status", "started")) == 1
    assert len(of(records, agent, "terminate")) == 1


async def test_pause_all_stops_a_command_until_resume_all(
    make_stack: StackFactory, event_log: EventLog, tmp_path: Path
) -> None:
    await asyncio.to_thread(make_stack)
    client = GroveClient(event_log)
    ticks = tmp_path / "ticks.txt"
    agent = await client.spawn("tick", ticking(ticks))
    await wait_status(event_log, agent, "started")
    assert await grows(ticks, 0.5)

    await control(event_log, "pause_all")
    paused = await wait_status(event_log, agent, "paused")
    assert paused.payload.details["by"] == "operator"
    await asyncio.sleep(0.2)
    assert not await grows(ticks, 1.0), "a paused command went on writing"

    await control(event_log, "resume_all")
    resumed = await wait_status(event_log, agent, "resumed")
    assert resumed.payload.details["from"] == "pause"
    assert await grows(ticks, 0.5)

    await client.stop(agent)
    (ended,) = await wait_ends(event_log, agent)
    assert ended.reason == "stopped"


async def test_a_terminate_from_elsewhere_ends_the_run_without_a_second_terminate(
    make_stack: StackFactory, event_log: EventLog, tmp_path: Path
) -> None:
    await asyncio.to_thread(make_stack)
    client = GroveClient(event_log)
    ticks = tmp_path / "ticks.txt"
    agent = await client.spawn("tick", ticking(ticks))
    started = await wait_status(event_log, agent, "started")
    assert await grows(ticks, 0.3)

    timeout = TerminateEvent(
        event_id=new_id(),
        agent_id=agent,
        tree_id=started.tree_id,
        timestamp=datetime.now(UTC),
        reason="timeout",
        error="max_runtime exceeded",
    )
    await event_log.append(timeout, expect_last_seq=0)
    await asyncio.sleep(0.5)

    assert not await grows(ticks, 1.0), "the command still runs after its terminate"
    records = await events(event_log)
    assert [e.event_id for e in of(records, agent, "terminate")] == [timeout.event_id]
    assert of(records, agent, "status", "stopped") == []


async def test_a_stop_ends_a_run_whose_first_cancellation_was_lost(
    make_stack: StackFactory, event_log: EventLog
) -> None:
    await asyncio.to_thread(make_stack)
    client = GroveClient(event_log)
    agent = await client.spawn("wait", python_agent("swallows_a_cancel"))
    await wait_status(event_log, agent, "checkpoint", summary="waiting")
    await client.stop(agent, "enough")
    (ended,) = await wait_ends(event_log, agent, timeout=30)
    assert (ended.reason, ended.result.summary) == ("stopped", "enough")


async def test_a_run_that_ignores_its_stop_is_ended_on_the_log_after_the_grace(
    make_stack: StackFactory, event_log: EventLog
) -> None:
    await asyncio.to_thread(make_stack, GROVE_STOP_GRACE="2")
    client = GroveClient(event_log)
    agent = await client.spawn("ignore", python_agent("deaf"))
    await wait_status(event_log, agent, "checkpoint", summary="not listening")
    await client.stop(agent, "enough")
    (ended,) = await wait_ends(event_log, agent, timeout=15)
    assert ended.reason == "stopped"
    assert ended.result.summary == "enough (its run did not end when cancelled)"
    await asyncio.sleep(6)  # the run returns meanwhile: nothing more is appended for it
    records = await events(event_log)
    assert len(of(records, agent, "terminate")) == 1
    assert of(records, agent, "status", "completed") == []


# -- several spawners ---------------------------------------------------------------------------


async def test_two_spawners_start_each_agent_once(
    make_stack: StackFactory, event_log: EventLog
) -> None:
    await asyncio.to_thread(make_stack, spawners=2)
    client = GroveClient(event_log)
    agents = [await client.spawn("go", python_agent("silent")) for _ in range(24)]

    for agent in agents:
        await wait_ends(event_log, agent, timeout=30)
    await asyncio.sleep(0.5)

    records = await events(event_log)
    started = [e for a in agents for e in of(records, a, "status", "started")]
    assert Counter(e.agent_id for e in started) == Counter(dict.fromkeys(agents, 1))
    ends = [e for a in agents for e in of(records, a, "terminate")]
    assert Counter(e.agent_id for e in ends) == Counter(dict.fromkeys(agents, 1))
    assert {e.reason for e in ends} == {"completed"}


async def test_the_agents_of_a_killed_spawner_end_as_failed_naming_it(
    make_stack: StackFactory, event_log: EventLog
) -> None:
    timeout_s = 3.0
    stack = await asyncio.to_thread(
        make_stack,
        spawners=2,
        GROVE_SPAWNER_TIMEOUT=str(timeout_s),
        GROVE_HEARTBEAT_INTERVAL="0.5",
    )
    client = GroveClient(event_log)
    agents = [await client.spawn("60", python_agent("remembers")) for _ in range(6)]
    by_spawner: dict[str, list[str]] = {}
    for agent in agents:
        started = await wait_status(event_log, agent, "started")
        by_spawner.setdefault(started.payload.details["spawner_id"], []).append(agent)
    victim = next(iter(by_spawner))
    lost = by_spawner[victim]

    killed_at = time.monotonic()
    await asyncio.to_thread(stack.services[victim].kill)
    ends = [(await wait_ends(event_log, a, timeout=timeout_s + 10))[0] for a in lost]
    elapsed = time.monotonic() - killed_at

    assert elapsed < timeout_s + 5, f"lost agents ended {elapsed:.1f}s after the kill"
    assert {e.reason for e in ends} == {"failed"}
    for ended in ends:
        assert ended.error is not None
        assert ended.error.startswith(f"spawner {victim} lost (no heartbeat for ")
    await asyncio.sleep(1.0)
    records = await events(event_log)
    assert Counter(e.agent_id for a in lost for e in of(records, a, "terminate")) == Counter(
        dict.fromkeys(lost, 1)
    )
    survivors = [a for a in agents if a not in lost]
    assert all(of(records, a, "terminate") == [] for a in survivors)


async def test_admissions_owned_by_a_killed_spawner_are_started_by_the_other(
    make_stack: StackFactory, event_log: EventLog
) -> None:
    # The survivor still hears the victim for three heartbeat intervals (1.5 s) and leaves
    # the victim's share of the admissions to it until then; after that they are its own.
    stack = await asyncio.to_thread(
        make_stack,
        spawners=2,
        GROVE_SPAWNER_TIMEOUT="20",
        GROVE_HEARTBEAT_INTERVAL="0.5",
    )
    client = GroveClient(event_log)
    warm_up = [await client.spawn("go", python_agent("silent")) for _ in range(12)]
    for agent in warm_up:
        await wait_ends(event_log, agent, timeout=30)
    records = await events(event_log)
    assert {
        e.payload.details["spawner_id"]
        for a in warm_up
        for e in of(records, a, "status", "started")
    } == {"spawner-1", "spawner-2"}, "both spawners take their share while both are alive"

    await asyncio.to_thread(stack.services["spawner-1"].kill)
    killed_at = time.monotonic()
    agents = [await client.spawn("go", python_agent("silent")) for _ in range(12)]
    ends = [(await wait_ends(event_log, a, timeout=20))[0] for a in agents]
    elapsed = time.monotonic() - killed_at

    # Well inside the spawner timeout: the admissions moved once the heartbeats stopped.
    assert elapsed < 10, f"the last agent ended {elapsed:.1f}s after the kill"
    assert {e.reason for e in ends} == {"completed"}
    records = await events(event_log)
    started = [e for a in agents for e in of(records, a, "status", "started")]
    assert Counter(e.agent_id for e in started) == Counter(dict.fromkeys(agents, 1))
    assert {e.payload.details["spawner_id"] for e in started} == {"spawner-2"}


async def test_a_spawner_that_shuts_down_hands_its_share_of_admissions_over_at_once(
    make_stack: StackFactory, event_log: EventLog
) -> None:
    # Heard from within three intervals (15 s), a silent spawner would keep its share that
    # long; one that shuts down says so in a last heartbeat.
    stack = await asyncio.to_thread(make_stack, spawners=2, GROVE_HEARTBEAT_INTERVAL="5")
    client = GroveClient(event_log)
    await asyncio.to_thread(stack.services["spawner-1"].stop)
    stopped_at = time.monotonic()
    agents = [await client.spawn("go", python_agent("silent")) for _ in range(12)]
    starts = [await wait_status(event_log, a, "started") for a in agents]
    elapsed = time.monotonic() - stopped_at

    assert elapsed < 8, f"the last agent started {elapsed:.1f}s after the stop"
    assert {s.payload.details["spawner_id"] for s in starts} == {"spawner-2"}


async def test_agents_admitted_while_no_spawner_runs_start_when_one_comes_back(
    make_stack: StackFactory, event_log: EventLog
) -> None:
    stack = await asyncio.to_thread(make_stack)
    client = GroveClient(event_log)
    first = await client.spawn("go", python_agent("silent"))
    await wait_ends(event_log, first, timeout=30)
    await asyncio.sleep(1.5)  # the spawner's projection is written past the first agent

    await asyncio.to_thread(stack.services["spawner-1"].kill)
    agents = [await client.spawn("go", python_agent("silent")) for _ in range(5)]
    for agent in agents:
        await wait_status(event_log, agent, "admitted")
    records = await events(event_log)
    assert all(of(records, a, "status", "started") == [] for a in agents)

    await asyncio.to_thread(stack.restart, "spawner-1")
    ends = [(await wait_ends(event_log, a, timeout=30))[0] for a in agents]
    assert {e.reason for e in ends} == {"completed"}
    records = await events(event_log)
    started = [e for a in agents for e in of(records, a, "status", "started")]
    assert Counter(e.agent_id for e in started) == Counter(dict.fromkeys(agents, 1))


# -- completion ---------------------------------------------------------------------------------


async def test_a_run_that_ends_well_without_saying_so_gets_an_explicit_completion(
    make_stack: StackFactory, event_log: EventLog
) -> None:
    await asyncio.to_thread(make_stack)
    client = GroveClient(event_log)
    silent = await client.spawn("hush", python_agent("silent"))
    talker = await client.spawn("talk", python_agent("says_completed"))
    command = await client.spawn("echo", build_config("command", command=["echo", "hi"]))
    spender = await client.spawn("spend", python_agent("uses_tokens"))

    ended = {a: (await wait_ends(event_log, a))[0] for a in (silent, talker, command, spender)}

    assert {e.reason for e in ended.values()} == {"completed"}
    records = await events(event_log)
    for agent in (silent, command, spender):
        (completed,) = of(records, agent, "status", "completed")
        assert completed.payload.details["system_notice"] == "silent_completion"
        statuses = of(records, agent, "status")
        assert statuses.index(completed) == len(statuses) - 1  # just before the terminate
    (own,) = of(records, talker, "status", "completed")
    assert own.payload.summary == "said so"
    assert "system_notice" not in own.payload.details
    assert ended[spender].usage.tokens == 150
    (notice,) = of(records, spender, "status", "completed")
    assert notice.payload.details["tokens"] == 150
    checkpoints = of(records, spender, "status", "checkpoint")
    assert [c.payload.details["tokens"] for c in checkpoints] == [120, 150]


# -- admissions ---------------------------------------------------------------------------------


def admissions(port: int) -> dict[str, float]:
    """The spawner's `grove_spawner_admissions_total`, by what answered."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    pattern = r'^grove_spawner_admissions_total\{answered_by="(\w+)"\} (\S+)$'
    return {m[1]: float(m[2]) for m in re.finditer(pattern, text, flags=re.MULTILINE)}


async def test_admissions_of_spawns_are_answered_by_the_projection_and_a_fork_by_the_log(
    make_stack: StackFactory, event_log: EventLog
) -> None:
    stack = await asyncio.to_thread(make_stack)
    port = stack.services["spawner-1"].http_port
    client = GroveClient(event_log)
    spawned = [await client.spawn(f"t{i}", python_agent("says_completed")) for i in range(3)]
    for agent in spawned:
        (end,) = await wait_ends(event_log, agent)
        assert end.reason == "completed"
    assert admissions(port) == {"projection": 3.0}

    fork = await client.fork(spawned[0], "again")  # a fork's spawn is read from the log
    (end,) = await wait_ends(event_log, fork)
    assert end.reason == "completed"
    assert admissions(port) == {"projection": 3.0, "log": 1.0}
    records = await events(event_log)
    for agent in [*spawned, fork]:
        assert len(of(records, agent, "status", "started")) == 1

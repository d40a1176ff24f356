"""AgentGrove measured with all its services running, as `grove up` runs them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from nats.aio.msg import Msg
from nats.js import api as js_api

from agentgrove import GroveClient
from agentgrove.stack import Stack
from bench.stats import latency_summary, rate
from grove_core.log import EventLog
from grove_events import AgentConfig, SpawnEvent, new_id

REPO = Path(__file__).resolve().parent.parent
TRIVIAL = AgentConfig(runtime="python", entrypoint="bench.agents:trivial")
HOLDER = AgentConfig(runtime="python", entrypoint="bench.agents:holder")
#: Limits loose enough that nothing in the benchmark is queued or rejected.
CONFIG = """\
resources:
  global:
    max_concurrent_agents: 1000000
"""


@dataclass
class Watch:
    """Follows the `started` statuses and the terminates of the log, from now on (with
    `starts=False`, the terminates only: a burst's watcher reads one event per agent, not
    four, and leaves the CPU to the stack it measures)."""

    log: EventLog
    starts: bool = True
    started: dict[str, asyncio.Future[float]] = field(default_factory=dict)
    ended: dict[str, asyncio.Future[float]] = field(default_factory=dict)
    #: Called with each terminate's agent id.
    on_end: Callable[[str], None] | None = None
    _subs: list[Any] = field(default_factory=list)

    async def start(self) -> None:
        """Subscribe (ordered consumers, new messages only)."""
        js = self.log.js
        new = js_api.DeliverPolicy.NEW
        follow = [("grove.terminate.*", self._end)]
        if self.starts:
            follow.append(("grove.status.*", self._status))
        for subject, cb in follow:
            self._subs.append(
                await js.subscribe(
                    subject,
                    cb=cb,
                    ordered_consumer=True,
                    deliver_policy=new,
                    pending_msgs_limit=-1,
                    pending_bytes_limit=-1,
                )
            )

    async def stop(self) -> None:
        """Unsubscribe."""
        for sub in self._subs:
            await sub.unsubscribe()

    def expect(self, agent_id: str) -> tuple[asyncio.Future[float], asyncio.Future[float]]:
        """Futures of the agent's `started` and terminate arrival times."""
        loop = asyncio.get_running_loop()
        started = self.started[agent_id] = loop.create_future()
        ended = self.ended[agent_id] = loop.create_future()
        return started, ended

    async def _status(self, msg: Msg) -> None:
        now = time.perf_counter()
        agent_id = msg.subject.rsplit(".", 1)[-1]
        future = self.started.get(agent_id)
        if future is None or future.done():
            return
        if json.loads(msg.data).get("status_type") == "started":
            future.set_result(now)

    async def _end(self, msg: Msg) -> None:
        now = time.perf_counter()
        agent_id = msg.subject.rsplit(".", 1)[-1]
        future = self.ended.get(agent_id)
        if future is not None and not future.done():
            future.set_result(now)
            if self.on_end is not None:
                self.on_end(agent_id)


@contextlib.asynccontextmanager
async def watching(log: EventLog, *, starts: bool = True) -> AsyncIterator[Watch]:
    """A started `Watch` of the log, stopped at the end."""
    watch = Watch(log, starts=starts)
    await watch.start()
    try:
        yield watch
    finally:
        await watch.stop()


def new_stack(
    data_dir: Path, nats_url: str, spawners: int, env: dict[str, str] | None = None
) -> Stack:
    """The four services against `nats_url`, limits from CONFIG, `env` added to the services'
    environment (not started yet)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    config = data_dir / "grove.yaml"
    config.write_text(CONFIG)
    return Stack(
        data_dir,
        nats_url=nats_url,
        spawners=spawners,
        config_file=config,
        extra_env={"PYTHONPATH": str(REPO), "GROVE_LOG_LEVEL": "WARNING", **(env or {})},
    )


@contextlib.asynccontextmanager
async def running_stack(
    data_dir: Path, nats_url: str, spawners: int, env: dict[str, str] | None = None
) -> AsyncIterator[Stack]:
    """A started stack, stopped on the way out; also when cancelled while it starts (the
    start, in a thread, finishes first, so that no service is left behind)."""
    stack = new_stack(data_dir, nats_url, spawners, env)
    starting = asyncio.ensure_future(asyncio.to_thread(stack.start, 120))
    try:
        await asyncio.shield(starting)
        yield stack
    finally:
        with contextlib.suppress(Exception):
            await starting
        await asyncio.to_thread(stack.stop)


def _spawn(config: AgentConfig, task: str = "bench", parent: str | None = None) -> SpawnEvent:
    agent = new_id()
    return SpawnEvent(
        event_id=new_id(),
        agent_id=agent,
        tree_id=None if parent else agent,
        timestamp=datetime.now(UTC),
        task=task,
        parent=parent,
        config=config,
    )


async def spawn_to_started(
    log: EventLog, watch: Watch, count: int, warmup: int = 5, timeout: float = 60.0
) -> dict[str, Any]:
    """Latency from appending a spawn to seeing its `started`, one trivial agent at a time
    (each ends before the next is spawned)."""
    samples: list[float] = []
    for index in range(warmup + count):
        event = _spawn(TRIVIAL)
        started, ended = watch.expect(event.agent_id)
        began = time.perf_counter()
        await log.append(event)
        at = await asyncio.wait_for(started, timeout)
        await asyncio.wait_for(ended, timeout)
        if index >= warmup:
            samples.append(at - began)
    return latency_summary(samples)


async def burst(
    log: EventLog, watch: Watch, count: int, timeout: float, parent: str | None = None
) -> dict[str, Any]:
    """`count` trivial agents appended at once (pipelined); time until every one has ended."""
    events = [_spawn(TRIVIAL, parent=parent) for _ in range(count)]
    remaining = {event.agent_id for event in events}
    all_ended = asyncio.Event()

    def ended(agent_id: str) -> None:
        remaining.discard(agent_id)
        if not remaining:
            all_ended.set()

    for event in events:
        watch.expect(event.agent_id)
    watch.on_end = ended
    first_seq = await log.last_seq()
    began = time.perf_counter()
    try:
        await log.append_many(events)
        appended = time.perf_counter() - began
        with contextlib.suppress(TimeoutError):  # reported as incomplete
            await asyncio.wait_for(all_ended.wait(), timeout)
    finally:
        watch.on_end = None
    elapsed = time.perf_counter() - began
    done = count - len(remaining)
    log_events = await log.last_seq() - first_seq
    return {
        "agents": count,
        "ended": done,
        "complete": done == count,
        "seconds": round(elapsed, 3),
        "append_seconds": round(appended, 3),
        "agents_per_s": rate(done, elapsed),
        "log_events": log_events,
        "log_events_per_s": rate(log_events, elapsed),
    }


async def fan_out(log: EventLog, watch: Watch, children: int, timeout: float) -> dict[str, Any]:
    """A holder parent, then `children` trivial children of it at once: time until all ended."""
    parent = _spawn(HOLDER, task="600")
    started, ended = watch.expect(parent.agent_id)
    await log.append(parent)
    await asyncio.wait_for(started, timeout)
    result = await burst(log, watch, children, timeout, parent=parent.agent_id)
    await GroveClient(log).stop(parent.agent_id, reason="benchmark fan-out done")
    await asyncio.wait_for(ended, timeout)
    return {"children": children, **{k: v for k, v in result.items() if k != "agents"}}


def rss_kib(pid: int) -> int | None:
    """Resident set size of a process in KiB (Linux /proc), None when unknown."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def cpu_seconds(pid: int) -> float | None:
    """User and system CPU time a process has used, in seconds (Linux /proc), None when
    unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stack_pids(stack: Stack, nats_pid: int | None) -> dict[str, int]:
    """The nats-server's and each service's process id, by name."""
    pids = {"nats-server": nats_pid} if nats_pid is not None else {}
    for name, service in stack.services.items():
        if service.process is not None:
            pids[name] = service.process.pid
    return pids


def stack_cpu(pids: dict[str, int]) -> dict[str, float | None]:
    """CPU seconds used so far by each process of the stack."""
    return {name: cpu_seconds(pid) for name, pid in pids.items()}


def stack_rss(stack: Stack, nats_pid: int | None) -> dict[str, int | None]:
    """RSS (KiB) of the nats-server and of each service process."""
    return {name: rss_kib(pid) for name, pid in stack_pids(stack, nats_pid).items()}

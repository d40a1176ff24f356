"""A chaos run: many agent trees while services are killed and nats-server restarts.

The driver starts the local stack (two spawners), spawns trees of `chaos.agents:manager`
agents (whose workers ask the caller questions, store and read artifacts and message their
parents), answers every question as a scripted caller, stops and forks some trees, and
meanwhile SIGKILLs a random service every few seconds (and restarts it), and kills and
restarts nats-server at set moments. When every agent has ended and no question is open (or
the time is up) it stops the services cleanly and checks the promises:

- every agent (spawned or forked) has exactly one terminate;
- no agent started twice;
- every question answered exactly once, the answer delivered to its asker once (and an asker
  that completed answered with it);
- every message to an agent in its inbox once; every inbox in log order;
- every live artifact's blob in the bucket, and each stored once;
- each service's stored projection equals a from-scratch fold of the log up to its checkpoint;
- no admission is left waiting for a start (the spawners' fold of the log says none);
- nothing was dead-lettered.

It prints a summary, writes it as JSON (`--out`), and exits 1 if any check failed.
Everything runs on 127.0.0.1 and stops by itself within `--duration` plus the drain time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import re
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from agentgrove.client import GroveClient
from agentgrove.routing import AlreadyAnswered, RouterError, UnknownRequest
from agentgrove.stack import Stack
from chaos.agents import role_of
from grove_artifacts.blobs import BlobStore
from grove_artifacts.domain import ArtifactIndex
from grove_artifacts.domain import evolve as evolve_artifacts
from grove_core.log import EventLog, LogError
from grove_core.natsserver import LocalNatsCluster, LocalNatsServer
from grove_core.projection import ProjectionStore
from grove_core.records import Recorded
from grove_core.rows import FoldState
from grove_events import (
    AgentConfig,
    ControlEvent,
    ForkEvent,
    HitlEvent,
    MessageEvent,
    SpawnEvent,
    StatusEvent,
    TerminateEvent,
    new_id,
)
from grove_governor.domain import GovernorState
from grove_governor.domain import evolve as evolve_governor
from grove_router.domain import RouterState
from grove_router.domain import evolve as evolve_router
from grove_spawner.domain import SpawnerState
from grove_spawner.domain import evolve as evolve_spawner

ROOT = Path(__file__).resolve().parent.parent
KILLABLE = ("governor", "router", "artifacts", "spawner-1", "spawner-2")
CONFIG = """
resources:
  global: {max_concurrent_agents: 5000}
  per_parent: {max_children: 50}
  per_tree: {max_depth: 6, max_agents: 500}
"""


@dataclass(frozen=True)
class Plan:
    """The size and pace of a run."""

    agents: int
    depth: int
    fanout: int
    duration: float
    kill_every: float
    nats_restarts: int
    drain: float
    seed: int
    #: On a three-node nats-server cluster (stream replicas 3), killing one node at a time.
    cluster: bool = False
    #: The services' GROVE_APPEND_BATCH_FROM (0: each append alone).
    append_batch_from: int = 0

    @property
    def per_tree(self) -> int:
        """Agents in one tree: 1 + fanout + fanout² + … down to `depth`."""
        return sum(self.fanout**level for level in range(self.depth + 1))

    @property
    def trees(self) -> int:
        """Roots to spawn for about `agents` agents."""
        return max(1, round(self.agents / self.per_tree))


@dataclass
class Disruptions:
    """What the driver did to the stack."""

    kills: Counter[str] = field(default_factory=Counter)
    nats_restarts: int = 0
    stops: int = 0
    forks: int = 0
    append_retries: int = 0
    #: request id -> event id of the scripted caller's answer (reused on every retry)
    answers: dict[str, str] = field(default_factory=dict)
    answer_retries: int = 0


# -- driving ---------------------------------------------------------------------------------------


async def append_retrying(
    log: EventLog, event: Any, disruptions: Disruptions, deadline: float
) -> None:
    """Append until acknowledged: the same event id, so a retry after a lost ack is stored once."""
    while True:
        try:
            await log.append(event)
        except LogError:
            if time.monotonic() > deadline:
                raise
            disruptions.append_retries += 1
            await asyncio.sleep(0.5)
        else:
            return


async def spawn_trees(
    log: EventLog, plan: Plan, roots: list[str], disruptions: Disruptions, rng: random.Random
) -> None:
    """Spawn the roots spread over the first half of the run."""
    pause = plan.duration * 0.5 / plan.trees
    task = json.dumps({"depth": plan.depth, "fanout": plan.fanout, "sleep": 0.3})
    for _ in range(plan.trees):
        agent_id = new_id()
        event = SpawnEvent(
            event_id=new_id(),
            agent_id=agent_id,
            task=task,
            config=AgentConfig(runtime="python", entrypoint="chaos.agents:manager"),
            timestamp=datetime.now(UTC),
        )
        await append_retrying(log, event, disruptions, time.monotonic() + 120)
        roots.append(agent_id)
        await asyncio.sleep(pause * rng.uniform(0.5, 1.5))


async def steer(
    log: EventLog, plan: Plan, roots: list[str], disruptions: Disruptions, rng: random.Random
) -> None:
    """Now and then stop a root, or fork one (the fork runs a tree of its own)."""
    end = time.monotonic() + plan.duration * 0.6
    while time.monotonic() < end:
        await asyncio.sleep(rng.uniform(0.5, 1.5))
        if len(roots) < 4:
            continue
        target = rng.choice(roots[:-2])
        event: ControlEvent | ForkEvent
        if rng.random() < 0.5:
            event = ControlEvent(
                event_id=new_id(),
                agent_id=target,
                action="stop",
                reason="chaos: stopped by the driver",
                timestamp=datetime.now(UTC),
            )
            disruptions.stops += 1
        else:
            event = ForkEvent(
                event_id=new_id(),
                agent_id=new_id(),
                source_agent=target,
                reason="chaos: forked by the driver",
                timestamp=datetime.now(UTC),
            )
            disruptions.forks += 1
        await append_retrying(log, event, disruptions, time.monotonic() + 60)


async def answer_questions(log: EventLog, disruptions: Disruptions, done: asyncio.Event) -> None:
    """The scripted caller: answers every open question `yes`. A retry of an answer whose
    outcome is unknown reuses its event id, so the log keeps it once."""
    routing = GroveClient(log).routing
    while not done.is_set():
        try:
            pending = await routing.pending()
        except LogError:  # the router or nats-server restarting
            pending = []
        for request in pending:
            request_id = request["request_id"]
            event_id = disruptions.answers.setdefault(request_id, new_id())
            try:
                await routing.answer(request_id, "yes", event_id=event_id)
            except AlreadyAnswered:
                continue
            except (UnknownRequest, RouterError, LogError):
                disruptions.answer_retries += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), 0.5)


async def open_questions(log: EventLog) -> int:
    """Questions not answered yet (-1 while the router does not answer)."""
    try:
        return len(await GroveClient(log).routing.pending())
    except LogError:
        return -1


def nats_nodes(stack: Stack, cluster: LocalNatsCluster | None) -> list[LocalNatsServer]:
    """The nats-servers a run may kill: the cluster's nodes, or the stack's own server."""
    if cluster is not None:
        return cluster.nodes
    assert stack.nats is not None
    return [stack.nats]


async def disrupt(
    stack: Stack,
    plan: Plan,
    disruptions: Disruptions,
    rng: random.Random,
    cluster: LocalNatsCluster | None = None,
) -> None:
    """SIGKILL a random service every `kill_every` seconds; at set times kill nats-server (on
    a cluster, one node) and bring it back."""
    start = time.monotonic()
    nats_at = [
        plan.duration * (i + 1) / (plan.nats_restarts + 1) for i in range(plan.nats_restarts)
    ]
    while (elapsed := time.monotonic() - start) < plan.duration:
        if nats_at and elapsed >= nats_at[0]:
            nats_at.pop(0)
            node = rng.choice(nats_nodes(stack, cluster))
            await asyncio.to_thread(node.kill)
            await asyncio.sleep(rng.uniform(0.5, 2.0) * (3 if cluster else 1))
            await asyncio.to_thread(node.start)
            disruptions.nats_restarts += 1
        name = rng.choice(KILLABLE)
        service = stack.services[name]
        await asyncio.to_thread(service.kill)
        disruptions.kills[name] += 1
        await asyncio.sleep(rng.uniform(0.2, 1.0))
        await asyncio.to_thread(service.start)
        await asyncio.sleep(plan.kill_every * rng.uniform(0.5, 1.5))
    await asyncio.to_thread(stack.wait_ready, 120.0)


# -- checking --------------------------------------------------------------------------------------


@dataclass
class LogFacts:
    """What the log says happened, counted per agent."""

    records: list[Recorded]
    named: set[str]
    terminates: Counter[str]
    starts: Counter[str]
    invalid: int

    @property
    def unfinished(self) -> set[str]:
        """Agents without a terminate."""
        return {a for a in self.named if self.terminates[a] == 0}


async def read_facts(log: EventLog) -> LogFacts:
    """Replay the whole log and count what matters."""
    records: list[Recorded] = []
    invalid = 0
    async for item in log.events(1):
        if isinstance(item, Recorded):
            records.append(item)
        else:
            invalid += 1
    named: set[str] = set()
    terminates: Counter[str] = Counter()
    starts: Counter[str] = Counter()
    for recorded in records:
        event = recorded.event
        if isinstance(event, SpawnEvent | ForkEvent):
            named.add(event.agent_id)
        elif isinstance(event, TerminateEvent):
            terminates[event.agent_id] += 1
        elif isinstance(event, StatusEvent) and event.status_type == "started":
            starts[event.agent_id] += 1
    return LogFacts(records, named, terminates, starts, invalid)


async def wait_until_finished(log: EventLog, deadline: float) -> LogFacts:
    """Read the log until every named agent has ended and no question is open, or the
    deadline passes."""
    while True:
        facts = await read_facts(log)
        if time.monotonic() > deadline:
            return facts
        if not facts.unfinished and await open_questions(log) == 0:
            return facts
        await asyncio.sleep(2.0)


def stored_state(database: Path, name: str, state_type: type[Any]) -> Any:
    """A service's state as its database holds it."""
    store = ProjectionStore(f"sqlite:///{database}")
    try:
        return state_type.from_rows(store.load(name)[1])
    finally:
        store.close()


def check_conversations(facts: LogFacts, router: RouterState) -> dict[str, list[str]]:
    """What went wrong with questions, messages and inboxes (empty lists when nothing did)."""
    by_seq = {r.seq: r.event for r in facts.records}
    asked: dict[str, str] = {}
    responses: dict[str, set[str]] = {}
    messages: list[tuple[int, str]] = []
    for recorded in facts.records:
        event = recorded.event
        if isinstance(event, HitlEvent) and event.action == "request":
            asked.setdefault(event.request_id, event.agent_id)
        elif isinstance(event, HitlEvent) and event.action == "response":
            responses.setdefault(event.request_id, set()).add(event.event_id)
        elif isinstance(event, MessageEvent) and event.to is not None:
            messages.append((recorded.seq, event.to))

    def received(agent_id: str) -> list[int]:
        """Seqs of what reached the agent: its inbox, and what is held for it."""
        route = router.routes.get(agent_id)
        held = [entry.seq for entry in route.held] if route is not None else []
        return [entry.seq for entry in router.inboxes.get(agent_id, [])] + held

    problems: dict[str, list[str]] = {"hitl": [], "messages": [], "inboxes": []}
    ends = {r.event.agent_id: r.event for r in facts.records if isinstance(r.event, TerminateEvent)}
    for request_id, asker in asked.items():
        given = responses.get(request_id, set())
        if len(given) != 1:
            problems["hitl"].append(f"{request_id} of {asker}: {len(given)} answers on the log")
            continue
        delivered = [
            seq
            for seq in received(asker)
            if isinstance(answer := by_seq.get(seq), HitlEvent)
            and answer.action == "response"
            and answer.request_id == request_id
        ]
        if len(delivered) != 1:
            problems["hitl"].append(f"{request_id}: answer delivered {len(delivered)} times")
        end = ends.get(asker)
        if end is not None and end.reason == "completed" and end.result.summary != "answer: yes":
            problems["hitl"].append(f"{asker} completed with {end.result.summary!r}")
    for seq, recipient in messages:
        count = received(recipient).count(seq)
        if count != 1:
            problems["messages"].append(f"message at seq {seq} reached {recipient} {count} times")
    for agent_id, entries in router.inboxes.items():
        seqs = [entry.seq for entry in sorted(entries, key=lambda e: e.index)]
        indices = sorted(entry.index for entry in entries)
        if seqs != sorted(set(seqs)) or indices != list(range(1, len(entries) + 1)):
            problems["inboxes"].append(f"inbox of {agent_id} out of order or repeated: {seqs[:8]}")
    return problems


def stored_twice(index: ArtifactIndex) -> list[str]:
    """Live artifacts of the same name and agent beyond the first (each worker puts one)."""
    seen = Counter((e.agent_id, e.name) for e in index.artifacts.values() if not e.deleted)
    return sorted(f"{agent}/{name}" for (agent, name), count in seen.items() if count > 1)


async def missing_blobs(log: EventLog, index: ArtifactIndex) -> list[str]:
    """Live artifacts whose blob is not in the bucket."""
    names = set(await (await BlobStore.open(log.js)).names())
    return sorted(
        a for a, entry in index.artifacts.items() if not entry.deleted and entry.sha256 not in names
    )


Evolve = Callable[[Any, Recorded], Any]


def projections(stack: Stack) -> list[tuple[str, Path, type[FoldState], Evolve]]:
    """Each service's projection: its name, its database, its state type and its fold."""
    folder = stack.data_dir
    found: list[tuple[str, Path, type[FoldState], Evolve]] = [
        ("governor", folder / "governor.db", GovernorState, evolve_governor),
        ("router", folder / "router.db", RouterState, evolve_router),
        ("artifacts", folder / "artifacts.db", ArtifactIndex, evolve_artifacts),
    ]
    for name in stack.services:
        if name.startswith("spawner-"):
            projection = f"spawner-{name}"
            found.append((projection, folder / f"{projection}.db", SpawnerState, evolve_spawner))
    return found


def _json(rows: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(rows, sort_keys=True, default=str))  # type: ignore[no-any-return]


def compare_projection(
    name: str, database: Path, state_type: type[FoldState], evolve: Evolve, facts: LogFacts
) -> str | None:
    """None when the stored projection equals a fresh fold up to its checkpoint, else why not."""
    store = ProjectionStore(f"sqlite:///{database}")
    try:
        checkpoint, stored = store.load(name)
    finally:
        store.close()
    state: Any = state_type.from_rows({})
    for recorded in facts.records:
        if recorded.seq > checkpoint:
            break
        state = evolve(state, recorded)
    fresh = {k: v for k, v in state.take_dirty().items() if v is not None}
    stored_json, fresh_json = _json(stored), _json(fresh)
    if stored_json == fresh_json:
        return None
    differing = sorted(
        key
        for key in stored_json.keys() | fresh_json.keys()
        if stored_json.get(key) != fresh_json.get(key)
    )
    return f"{name}: {len(differing)} rows differ from a replay (e.g. {differing[:3]})"


def waiting_admissions(records: list[Recorded]) -> list[str]:
    """Agents whose newest admission no instance started from and no end followed, as the
    spawners' fold of the whole log finds them."""
    state = SpawnerState()
    for recorded in records:
        state = evolve_spawner(state, recorded)
    return sorted(state.admitted)


async def _quiet(_: Exception) -> None:
    """Connection errors are expected while nats-server restarts; appends retry."""


# -- the run ---------------------------------------------------------------------------------------


async def run(plan: Plan, folder: Path, out: Path | None) -> int:
    """One chaos run in `folder`; returns the exit code."""
    rng = random.Random(plan.seed)  # noqa: S311 - a repeatable schedule, not a secret
    config = folder / "grove.yaml"
    await asyncio.to_thread(folder.mkdir, parents=True, exist_ok=True)
    await asyncio.to_thread(config.write_text, CONFIG)
    stack = Stack(
        folder / "stack",
        spawners=2,
        config_file=config,
        extra_env={
            "PYTHONPATH": str(ROOT),
            "GROVE_SPAWNER_TIMEOUT": "4",
            "GROVE_HEARTBEAT_INTERVAL": "0.5",
            "GROVE_LOG_LEVEL": "WARNING",
            "GROVE_APPEND_BATCH_FROM": str(plan.append_batch_from),
        },
    )
    began = time.monotonic()
    cluster = LocalNatsCluster(folder / "nats-cluster") if plan.cluster else None
    disruptions = Disruptions()
    roots: list[str] = []
    try:  # whatever fails, what was started is stopped (finally)
        if cluster is not None:
            await asyncio.to_thread(cluster.start)
            stack.nats_url, stack.stream_replicas = cluster.url, 3
        await asyncio.to_thread(stack.start)
        log = await EventLog.connect(stack.url, name="chaos-driver", error_cb=_quiet)
        try:
            where = "a three-node nats-server cluster" if cluster else "one nats-server"
            print(f"chaos: {plan.trees} trees of {plan.per_tree} agents on {where}, "
                  f"{plan.duration:.0f}s of kills every ~{plan.kill_every:g}s, "
                  f"{plan.nats_restarts} nats-server restarts", flush=True)  # fmt: skip
            answered = asyncio.Event()
            caller = asyncio.create_task(answer_questions(log, disruptions, answered))
            try:
                await asyncio.gather(
                    spawn_trees(log, plan, roots, disruptions, rng),
                    steer(log, plan, roots, disruptions, rng),
                    disrupt(stack, plan, disruptions, rng, cluster),
                )
                facts = await wait_until_finished(log, time.monotonic() + plan.drain)
            finally:
                answered.set()
                await caller
            for service in stack.services.values():
                await asyncio.to_thread(service.stop)
            facts = await read_facts(log)
            index = stored_state(stack.data_dir / "artifacts.db", "artifacts", ArtifactIndex)
            lost_blobs = await missing_blobs(log, index)
        finally:
            await log.close()
        router = stored_state(stack.data_dir / "router.db", "router", RouterState)
        conversations = check_conversations(facts, router)
        mismatches = [
            problem
            for name, database, state_type, evolve in projections(stack)
            if (problem := compare_projection(name, database, state_type, evolve, facts))
        ]
    finally:
        await asyncio.to_thread(stack.stop)
        if cluster is not None:
            await asyncio.to_thread(cluster.stop)
    summary = summarize(
        plan,
        facts,
        disruptions,
        Outcome(
            mismatches,
            waiting_admissions(facts.records),
            conversations,
            lost_blobs,
            sum(1 for entry in index.artifacts.values() if not entry.deleted),
            stored_twice(index),
        ),
        time.monotonic() - began,
    )
    print_summary(summary)
    if out is not None:
        await asyncio.to_thread(out.write_text, json.dumps(summary, indent=2) + "\n")
    return 0 if all(summary["checks"].values()) else 1


@dataclass(frozen=True)
class Outcome:
    """What the checks after the run found."""

    mismatches: list[str]
    #: Agents with an admission no instance started from.
    waiting: list[str]
    conversations: dict[str, list[str]]
    lost_blobs: list[str]
    artifacts: int
    twice: list[str]


def summarize(
    plan: Plan, facts: LogFacts, disruptions: Disruptions, outcome: Outcome, seconds: float
) -> dict[str, Any]:
    """The run's figures and the verdict of each check."""
    mismatches, waiting = outcome.mismatches, outcome.waiting
    conversations, lost_blobs = outcome.conversations, outcome.lost_blobs
    twice_ended = sorted(a for a, n in facts.terminates.items() if n > 1)
    twice_started = sorted(a for a, n in facts.starts.items() if n > 1)
    ends = Counter(r.event.reason for r in facts.records if isinstance(r.event, TerminateEvent))
    roles = Counter(
        role_of(r.event.agent_id)
        for r in facts.records
        if isinstance(r.event, SpawnEvent) and '"depth": 0' in r.event.task
    )
    questions = sum(
        1 for r in facts.records if isinstance(r.event, HitlEvent) and r.event.action == "request"
    )
    sent = sum(1 for r in facts.records if isinstance(r.event, MessageEvent))
    checks = {
        "every agent ended exactly once": not facts.unfinished and not twice_ended,
        "no agent started twice": not twice_started,
        "every question answered once, delivered once to its asker": not conversations["hitl"],
        "every message delivered once": not conversations["messages"],
        "every inbox in log order, nothing repeated": not conversations["inboxes"],
        "every live artifact's blob in the bucket": not lost_blobs,
        "every artifact stored once": not outcome.twice,
        "projections equal a replay": not mismatches,
        "no admission left waiting for a start": not waiting,
        "nothing dead-lettered": facts.invalid == 0,
    }
    return {
        "agents": len(facts.named),
        "events": len(facts.records),
        "seconds": round(seconds, 1),
        "ends": dict(ends),
        "failure_causes": failure_causes(facts.records),
        "kills": dict(disruptions.kills),
        "nats_restarts": disruptions.nats_restarts,
        "cluster": plan.cluster,
        "append_batch_from": plan.append_batch_from,
        "stops": disruptions.stops,
        "forks": disruptions.forks,
        "append_retries": disruptions.append_retries,
        "workers": dict(roles),
        "questions": questions,
        "answers_given": len(disruptions.answers),
        "answer_retries": disruptions.answer_retries,
        "messages": sent,
        "artifacts": outcome.artifacts,
        "conversation_problems": {k: v[:5] for k, v in conversations.items() if v},
        "missing_blobs": lost_blobs[:5],
        "stored_twice": outcome.twice[:5],
        "unfinished": len(facts.unfinished),
        "unfinished_histories": {
            agent: [describe(r) for r in facts.records if r.event.agent_id == agent]
            for agent in sorted(facts.unfinished)[:3]
        },
        "ended_twice": twice_ended[:5],
        "started_twice": twice_started[:5],
        "projection_mismatches": mismatches,
        "admissions_waiting": waiting[:5],
        "checks": checks,
    }


#: What varies between two failures of the same cause: ids, spawner names, numbers.
_VARYING = re.compile(r"[0-9a-f]{8}-[0-9a-f-]{27,}|spawner-\d+|\d+")


def failure_causes(records: list[Recorded], top: int = 5) -> dict[str, int]:
    """The commonest errors of the agents that ended failed, ids and numbers masked."""
    causes = Counter(
        _VARYING.sub("#", (r.event.error or "no error given"))[:100]
        for r in records
        if isinstance(r.event, TerminateEvent) and r.event.reason == "failed"
    )
    return dict(causes.most_common(top))


def describe(recorded: Recorded) -> str:
    """One event of an agent's history, in a few words."""
    event = recorded.event
    detail = getattr(event, "status_type", None) or getattr(event, "reason", None) or ""
    detail = detail or getattr(event, "action", None) or ""
    return f"{recorded.seq} {event.type} {detail}".strip()


def print_summary(summary: dict[str, Any]) -> None:
    """The run's figures and checks, for a person."""
    print(f"chaos: {summary['agents']} agents, {summary['events']} events, "
          f"{summary['seconds']}s", flush=True)  # fmt: skip
    print(f"  ends: {summary['ends']}")
    for cause, count in summary["failure_causes"].items():
        print(f"    failed {count}: {cause}")
    print(f"  kills: {summary['kills']}, nats-server restarts: {summary['nats_restarts']}, "
          f"stops: {summary['stops']}, forks: {summary['forks']}, "
          f"append retries: {summary['append_retries']}")  # fmt: skip
    print(f"  workers: {summary['workers']}, questions: {summary['questions']}, "
          f"messages: {summary['messages']}, live artifacts: {summary['artifacts']}")  # fmt: skip
    for problem in summary["projection_mismatches"]:
        print(f"  {problem}")
    for kind, problems in summary["conversation_problems"].items():
        print(f"  {kind}: {'; '.join(problems)}")
    if summary["unfinished"]:
        print(f"  agents without a terminate: {summary['unfinished']}")
        for agent, history in summary["unfinished_histories"].items():
            print(f"    {agent}: {', '.join(history)}")
    for name, ok in summary["checks"].items():
        print(f"  [{'ok' if ok else 'FAILED'}] {name}", flush=True)


def parse(argv: list[str]) -> tuple[Plan, Path | None, Path | None]:
    """The plan from the command line."""
    parser = argparse.ArgumentParser(prog="python -m chaos", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--agents",
        type=int,
        default=5800,
        help="agents planned (stops and lost spawners cut some trees short)",
    )
    parser.add_argument("--depth", type=int, default=2, help="levels below each root")
    parser.add_argument("--fanout", type=int, default=3, help="children of each manager")
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of disruption")
    parser.add_argument("--kill-every", type=float, default=4.0, help="seconds between kills")
    parser.add_argument("--nats-restarts", type=int, default=2)
    parser.add_argument("--drain", type=float, default=180.0, help="seconds to let agents end")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="a short run for CI")
    parser.add_argument(
        "--cluster", action="store_true", help="on a three-node nats-server cluster (replicas 3)"
    )
    parser.add_argument(
        "--append-batch-from",
        type=int,
        default=0,
        help="the services send appends in atomic batches once this many are unacknowledged "
        "(GROVE_APPEND_BATCH_FROM; default 0: never)",
    )
    parser.add_argument("--dir", type=Path, help="keep the run's data here (default: temporary)")
    parser.add_argument("--out", type=Path, help="write the summary as JSON here")
    args = parser.parse_args(argv)
    if args.quick:
        args.agents, args.duration, args.kill_every, args.drain = 260, 25.0, 3.0, 90.0
        args.nats_restarts = 1
    plan = Plan(
        agents=args.agents,
        depth=args.depth,
        fanout=args.fanout,
        duration=args.duration,
        kill_every=args.kill_every,
        nats_restarts=args.nats_restarts,
        drain=args.drain,
        seed=args.seed,
        cluster=args.cluster,
        append_batch_from=args.append_batch_from,
    )
    if plan.append_batch_from < 0:
        parser.error("--append-batch-from must be 0 or more")
    return plan, args.dir, args.out


def main(argv: list[str] | None = None) -> None:
    """`python -m chaos`."""
    plan, folder, out = parse(sys.argv[1:] if argv is None else argv)
    with contextlib.ExitStack() as stack:
        if folder is None:
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="grove-chaos-")))
        sys.exit(asyncio.run(run(plan, folder, out)))

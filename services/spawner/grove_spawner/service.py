"""The spawner's application layer: start admitted agents once, run them, report their end.

Every replica folds the whole log into its projection, admissions included: the fold keeps
the admissions no instance has started from yet (`SpawnerState.admitted`). Replicas share them
without talking: each admission has one owner among the spawners heard from lately
(`domain.owner`, rendezvous hashing over the heartbeats), and the owner starts it the moment
its projection folds it. A replica looks over the waiting admissions every second: it starts
those it owns now (the owner it saw before has gone quiet, or an earlier attempt failed), and
any that has waited longer than `GROVE_SPAWNER_TIMEOUT`, whoever owns it. After a restart the
same look starts what was admitted while the spawner was away.

Two replicas may still try the same admission (their views of who is alive differ for a
moment): a replica appends `started` guarded by the admitted event's sequence, so exactly one
of them starts the instance; an admission of an instance that has started already, or of one
that has ended, starts nothing. An admission says what starts: a spawn, a fork (from its fork
event and the source's spawn) or a resume (a new instance on the same session). An instance's
terminate is guarded by the sequence of the agent's previous terminate, so it ends once,
whoever ends it.

What the admission of a spawn needs (the spawn, and whether the agent has started or been
stopped) comes from the replica's own projection, once it has folded the log up to the
admission (`FreshAgents`): no reads of the log on that path. Forks, resumes, and spawns the
projection did not fold (from before the process began) read the log.

The projection of started agents, fed with every event, also carries the live reactions:
stops and pauses (control events), ends decided elsewhere (a terminate from the governor or a
peer), and which peers are alive. Spawners publish heartbeats on core NATS; a peer silent for
`GROVE_SPAWNER_TIMEOUT` seconds is lost, and its agents end as failed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Self, cast

import nats.errors
from prometheus_client import Counter, Gauge
from pydantic import Field, model_validator

from agentgrove.artifacts import ArtifactError, store_result
from agentgrove.context import END_STATUSES, AgentContext, StartKind
from grove_core import metrics
from grove_core.auth import without_user
from grove_core.log import (
    APPEND_PATIENCE_S,
    ConcurrencyConflict,
    EventLog,
    LogError,
)
from grove_core.projection import ProjectionRunner, ProjectionStore
from grove_core.records import RawRecord, Recorded, decode_record
from grove_core.rpc import RpcServer
from grove_core.service import Service, run_service
from grove_core.settings import ServiceSettings
from grove_events import (
    ControlEvent,
    Event,
    ForkEvent,
    InvalidEvent,
    ResultSummary,
    SpawnEvent,
    StatusEvent,
    StatusPayload,
    TerminateEvent,
    Usage,
    new_id,
    rpc_subject,
    subject_for,
)
from grove_spawner.domain import (
    FOLD_VERSION,
    FOLDED_KINDS,
    SPAWNER_ID_DETAIL,
    START_KINDS,
    AdmissionDesk,
    FreshAgent,
    FreshAgents,
    PeerWatch,
    SpawnerState,
    StartedAgent,
    evolve,
    fork_spawn,
    owner,
    start_allowed,
)
from grove_spawner.runtimes import AgentRun, Outcome, Runtimes
from grove_spawner.sessions import (
    SessionOpen,
    SessionOpener,
    SessionStore,
    SessionSync,
    StoredSession,
    sessions_database_url,
)

log = logging.getLogger(__name__)

NAME = "spawner"
#: What the projection reads of the log: what its fold reads, and spawns and controls for
#: the hook (`FreshAgents`, the live reactions).
PROJECTION_KINDS = FOLDED_KINDS | {"spawn", "control"}
HEARTBEAT_SUBJECT = rpc_subject("spawner", "heartbeat")
#: Admissions handled at once (the others wait their turn, in the order they were folded).
#: Where the server syncs every write, a start waits on its `started` being synced; the more
#: starts wait at once, the more of their appends share one atomic batch (`bench/README.md`,
#: item 70). On two cores, 256 started as many agents a second as 64 did with the default sync.
START_CONCURRENCY = 256
#: How often a spawner looks over the admissions waiting for a start (`look_over_admissions`).
ADMISSIONS_LOOK_S = 1.0
#: A spawner shares the admissions with the peers heard from within this many heartbeat
#: intervals (itself included).
OWNER_HEARTBEATS = 3
#: How long a stopping spawner lets the starts it has begun finish.
START_DRAIN_S = 5.0
#: How long an admission waits for the projection to fold the log up to it, to be answered
#: from `FreshAgents`; after that it reads the log instead.
FRESH_WAIT_S = 2.0
#: Most messages on an agent's spawn subject read for its first valid spawn.
MAX_SPAWNS_READ = 16
#: How deep a chain of forks of forks is followed back to its spawn.
MAX_FORK_DEPTH = 64

#: How long a cancelled run may take to end (its runtime cleaning up: a subprocess terminated
#: then killed, an ACP turn cancelled) before it is cancelled again.
RECANCEL_AFTER_S = 8.0
#: Pause between further cancellations of a run that has not ended.
RECANCEL_EVERY_S = 1.0

#: First and longest pause between attempts to append an agent's end the log refused.
TERMINATE_RETRY_S = 0.5
TERMINATE_RETRY_MAX_S = 5.0

TERMINATE_RETRIES = Counter(
    "grove_spawner_end_retries_total",
    "Appends of an agent's end (last status, terminate) the log refused or did not "
    "acknowledge, and reads for it that got no answer, each tried again.",
)
RECANCELS = Counter(
    "grove_spawner_recancels_total",
    "Cancellations of an agent's run repeated because it had not ended after the last.",
)
ADMISSIONS = Counter(
    "grove_spawner_admissions_total",
    "Admissions handled, by what answered what they start: the projection (`FreshAgents`) "
    "or reads of the log (a fork, a resume, or a spawn the projection does not know or had "
    "not folded in time).",
    ["answered_by"],
)
COMPLETION_GUARDS_LOST = Counter(
    "grove_spawner_completion_guard_lost_total",
    "Appends of the completion said for an agent that ended well without saying so that lost "
    "their guard (a status of the agent the spawner had not folded yet), each followed by a "
    "read of the agent's newest status.",
)
WAITING_ADMISSIONS = Gauge(
    "grove_spawner_admissions_waiting",
    "Admissions in this spawner's projection that no instance has started from and that it "
    "has not decided on yet (set each time it looks them over, every second).",
)
STARTS_LOST = Counter(
    "grove_spawner_starts_lost_total",
    "Appends of `started` that lost their guard: another replica started the agent first, "
    "or another event of the agent came after its admission.",
)
LOST_AGENTS = Counter(
    "grove_spawner_lost_agents_total",
    "Agents ended as failed because the spawner running them was lost.",
    ["cause"],
)


class SpawnerSettings(ServiceSettings):
    """Spawner settings; `GROVE_SPAWNER_ID` must be stable across restarts of one replica."""

    spawner_id: str = Field(default_factory=socket.gethostname)
    heartbeat_interval: float = Field(
        default=2.0, gt=0, description="Seconds between heartbeats (GROVE_HEARTBEAT_INTERVAL)."
    )
    spawner_timeout: float = Field(
        default=15.0,
        gt=0,
        lt=30,
        description="Seconds of silence after which a peer spawner is lost "
        "(GROVE_SPAWNER_TIMEOUT, under 30).",
    )
    workspace: Path = Field(
        default_factory=Path.cwd,
        description="The directory agents work in: a command's or ACP agent's working "
        "directory, and the bound of the files and terminals an ACP agent is served "
        "(GROVE_WORKSPACE; default: the spawner's working directory).",
    )
    agent_nats_user: str | None = Field(
        default=None,
        description="The NATS user the processes of command and acp agents connect as "
        "(GROVE_AGENT_NATS_USER; deployed: the agent user). They never get the spawner's.",
    )
    agent_nats_password: str | None = Field(default=None, description="GROVE_AGENT_NATS_PASSWORD")
    agent_nats_creds: Path | None = Field(
        default=None, description="A NATS .creds file for agent processes (GROVE_AGENT_NATS_CREDS)."
    )
    session_sync: SessionSync = Field(
        default="normal",
        description="How a SQLite session file is synced: normal (at checkpoints; a power "
        "loss may lose the newest entries) or full (every write) (GROVE_SESSION_SYNC).",
    )
    stop_grace: float = Field(
        default=30.0,
        gt=0,
        description="Seconds a stopped agent's run may go on ignoring its cancellation before "
        "its end is appended regardless (GROVE_STOP_GRACE).",
    )

    @model_validator(mode="after")
    def _heartbeat_within_timeout(self) -> Self:
        if self.heartbeat_interval >= self.spawner_timeout:
            raise ValueError(
                f"GROVE_HEARTBEAT_INTERVAL ({self.heartbeat_interval}s) must be shorter than "
                f"GROVE_SPAWNER_TIMEOUT ({self.spawner_timeout}s), or live spawners look lost"
            )
        return self


@dataclass(frozen=True)
class Origin:
    """What an agent runs as: its spawn (for a fork, made from the fork and its source)."""

    spawn: SpawnEvent
    fork: ForkEvent | None = None
    source_session: str | None = None


@dataclass
class RunningAgent:
    """An agent instance this process is starting or running."""

    spawn: SpawnEvent
    tree_id: str
    start: StartKind = "spawn"
    fork: ForkEvent | None = None
    source_session: str | None = None
    message: str | None = None
    #: Sequence of the agent's last terminate before this instance (0: none), the guard of
    #: this instance's terminate.
    terminate_guard: int = 0
    tokens_before: int = 0
    started_seq: int = 0
    #: The newest status of this instance the spawner knows of: its `started`, or one its
    #: projection folded since (the guard of the completion it may say for the agent).
    status_seq: int = 0
    task: asyncio.Task[None] | None = None
    run: AgentRun | None = None
    stop_reason: str | None = None
    #: Someone else (the governor, a peer) appended this instance's terminate.
    ended_elsewhere: bool = False
    #: The agent appended `completed` or `failed` itself (seen on the log).
    reported_end: bool = False
    started_at: float = 0.0
    #: Cancels the run again until it ends (see `Spawner._cancel`).
    canceller: asyncio.Task[None] | None = None
    #: The run ignored cancellation past the grace; its end was appended without it.
    abandoned: bool = False
    #: The run's task has taken its first step: before it, a cancellation would end the task
    #: without running any of `_run`, its end included, so a stop is left for `_run` to see.
    began: bool = False
    #: The run is appending its end: cancelling it now could lose that append.
    ending: bool = False


def cut_to_budget(text: str, budget: int) -> tuple[str, bool]:
    """The summary within `budget` characters, and whether it was cut."""
    if len(text) <= budget:
        return text, False
    return text[:budget], True


def newest_within_budget(entries: list[str], budget: int) -> tuple[list[str], bool]:
    """The newest entries that fit in `budget` characters together, and whether anything was
    left out; an entry that fits only in part keeps its end (what came last before a failure)."""
    kept: list[str] = []
    left = budget
    for entry in reversed(entries):
        if left <= 0:
            break
        part = entry[-left:]
        kept.append(part)
        left -= len(part)
    kept.reverse()
    return kept, sum(map(len, kept)) < sum(map(len, entries))


def _decode(record: RawRecord | None) -> Event | None:
    if record is None:
        return None
    try:
        return decode_record(record).event
    except InvalidEvent:
        return None


class Spawner:
    """Runs admitted agents on their runtimes."""

    def __init__(
        self,
        event_log: EventLog,
        store: ProjectionStore,
        spawner_id: str,
        nats_url: str,
        *,
        sessions: SessionStore,
        heartbeat_interval: float = 2.0,
        spawner_timeout: float = 15.0,
        stop_grace: float = 30.0,
        workspace: Path | None = None,
        agent_credentials: dict[str, str] | None = None,
    ) -> None:
        self.log = event_log
        self.spawner_id = spawner_id
        #: The URL agents connect to, without any user in it: agents connect with their own.
        self.agent_nats_url = without_user(nats_url)
        self.sessions = sessions
        self.opener = SessionOpener(sessions)
        self.heartbeat_interval = heartbeat_interval
        self.spawner_timeout = spawner_timeout
        self.stop_grace = stop_grace
        self.workspace = workspace or Path.cwd()
        self.runtimes = Runtimes()
        #: GROVE_NATS_* settings for the processes of agents (never the spawner's own).
        self.agent_credentials = agent_credentials or {}
        self.running: dict[str, RunningAgent] = {}
        #: Agents spawned and not ended, from the projection's events (see `start`).
        self.fresh = FreshAgents()
        #: Whether a `pause_all` is in force (no `resume_all` after it yet).
        self.paused = False
        self.peers = PeerWatch(since=time.monotonic())
        #: Heartbeats only (not a peer's starts read from the log): the spawners that share
        #: the admissions now.
        self.beats = PeerWatch(since=time.monotonic())
        #: Agents whose admission is being started here.
        self.starting: set[str] = set()
        self.desk = AdmissionDesk(spawner_id)
        self._start_slots = asyncio.Semaphore(START_CONCURRENCY)
        self._start_tasks: set[asyncio.Task[None]] = set()
        #: Whether this spawner starts the admissions it folds (cleared when it shuts down; a
        #: test that hands admissions to `start` itself clears it too).
        self.takes_admissions = True
        #: Heartbeats sent out of turn, held until sent (the loop keeps only weak references).
        self._out_of_turn: set[asyncio.Task[None]] = set()
        #: Lost agents already ended (agent id -> started_seq of the instance), not retried.
        self._ended_lost: dict[str, int] = {}
        self.runner: ProjectionRunner[SpawnerState] = ProjectionRunner(
            name=f"spawner-{spawner_id}",
            log=event_log,
            store=store,
            state_type=SpawnerState,
            evolve=evolve,
            after_event=self._after_event,
            on_caught_up=self._on_caught_up,
            kinds=PROJECTION_KINDS,
            fold_version=FOLD_VERSION,
        )

    # -- starting ----------------------------------------------------------------------------

    def sharing(self, now: float) -> list[str]:
        """The spawners the admissions are shared among now: this one, and the peers whose
        heartbeats came lately."""
        alive = self.beats.alive(now, OWNER_HEARTBEATS * self.heartbeat_interval)
        if self.spawner_id not in alive:
            alive.append(self.spawner_id)
        return alive

    def _admission_folded(self, recorded: Recorded, status: StatusEvent) -> None:
        """A live admission, just folded: its owner starts it at once."""
        agent_id = status.agent_id
        if self.runner.state.admitted.get(agent_id) != recorded.seq:
            return  # an instance runs: the admission starts nothing, and waits for nothing
        now = time.monotonic()
        self.desk.saw(agent_id, recorded.seq, now)
        if owner(agent_id, self.sharing(now)) == self.spawner_id:
            self._launch(agent_id, recorded.seq, recorded)

    def look_over_admissions(self, now: float) -> None:
        """Start the waiting admissions due now (`AdmissionDesk.due`)."""
        waiting = self.runner.state.admitted
        busy = self.starting | self.running.keys()
        for agent_id, seq in self.desk.due(
            waiting, busy, self.sharing(now), now, self.spawner_timeout
        ):
            self._launch(agent_id, seq)
        WAITING_ADMISSIONS.set(self.desk.undecided(waiting))

    async def watch_admissions(self) -> None:
        """Look over the waiting admissions every `ADMISSIONS_LOOK_S`, once caught up."""
        await self.runner.caught_up.wait()
        while self.takes_admissions:
            try:
                self.look_over_admissions(time.monotonic())
            except Exception:
                log.exception("could not look over the waiting admissions; will retry")
            await asyncio.sleep(ADMISSIONS_LOOK_S)

    def _launch(self, agent_id: str, seq: int, recorded: Recorded | None = None) -> None:
        if not self.takes_admissions or agent_id in self.starting:
            return
        self.starting.add(agent_id)
        task = asyncio.create_task(
            self._start_admission(agent_id, seq, recorded), name=f"admission-{agent_id}"
        )
        self._start_tasks.add(task)
        task.add_done_callback(self._start_tasks.discard)

    async def _start_admission(self, agent_id: str, seq: int, recorded: Recorded | None) -> None:
        """Start from one admission, at most `START_CONCURRENCY` at once. An attempt that
        fails (the log unreachable) is not decided: the next look tries it again."""
        try:
            async with self._start_slots:
                if not self.takes_admissions:
                    return
                if recorded is None:
                    recorded = await self._read_admission(agent_id, seq)
                if recorded is not None and isinstance(recorded.event, StatusEvent):
                    await self.start(recorded, recorded.event)
            self.desk.decide(agent_id, seq)
        except Exception:
            log.exception("admission of %s at seq %s failed; will try again", agent_id, seq)
        finally:
            self.starting.discard(agent_id)

    async def _read_admission(self, agent_id: str, seq: int) -> Recorded | None:
        """The admission at `seq`, read from the log (None: it is not there any more)."""
        raw = await self.log.get_at(seq)
        try:
            recorded = None if raw is None else decode_record(raw)
        except InvalidEvent:
            recorded = None
        event = None if recorded is None else recorded.event
        if not (
            isinstance(event, StatusEvent)
            and event.status_type == "admitted"
            and event.agent_id == agent_id
        ):
            log.warning("admission of %s at seq %s is not in the log; ignoring", agent_id, seq)
            return None
        return recorded

    async def start(self, admitted: Recorded, status: StatusEvent) -> None:
        """Start the instance an admission is for, unless it started already or elsewhere."""
        agent_id = status.agent_id
        if agent_id in self.running:
            return
        kind = status.payload.details.get("start", "spawn")
        if kind not in START_KINDS:
            log.error("admission of %s names an unknown start %r; ignoring", agent_id, kind)
            return
        kind = cast(StartKind, kind)
        fresh = await self._fresh(admitted, status) if kind == "spawn" else None
        ADMISSIONS.labels("log" if fresh is None else "projection").inc()
        if fresh is not None:
            # The projection has folded the log past the admission, and the agent's first
            # spawn with it: no end, no `started` and no stop of it can be in the log unseen.
            if fresh.started:
                log.info(
                    "%s has started already; admission at seq %s ignored", agent_id, admitted.seq
                )
                return
            agent = await self._instance(status, kind, None, Origin(fresh.spawn))
        else:
            agent = await self._instance_from_log(agent_id, admitted, status, kind)
        if agent is None:
            return
        spawn = agent.spawn
        self.running[agent_id] = agent
        details: dict[str, Any] = {
            SPAWNER_ID_DETAIL: self.spawner_id,
            "runtime": spawn.config.runtime,
            "start": kind,
        }
        if spawn.fork_from is not None:
            details["fork_of"] = spawn.fork_from
        try:
            appended = await self.log.append(
                self._status(agent, "started", f"started on {spawn.config.runtime}", details),
                expect_last_seq=admitted.seq,
                # A `started` stored whose acknowledgement was lost must be found as this
                # spawner's: given up, the admission comes again, the agent has started, and
                # nobody would run it.
                patience=APPEND_PATIENCE_S,
            )
        except ConcurrencyConflict:
            self.running.pop(agent_id, None)
            STARTS_LOST.inc()
            log.info("%s was started elsewhere", agent_id)
            return
        except BaseException:
            self.running.pop(agent_id, None)
            raise
        agent.started_seq = agent.status_seq = appended.seq
        agent.started_at = time.monotonic()
        if kind == "spawn" and spawn.timestamp is not None:
            metrics.SPAWN_TO_STARTED.observe(
                max(0.0, (datetime.now(UTC) - spawn.timestamp).total_seconds())
            )
        if fresh is None:
            await self._check_stopped(agent)
        elif fresh.stop is not None:  # a stop folded later is handled as it comes (`_stop`)
            agent.stop_reason = agent.stop_reason or fresh.stop
        if agent.ended_elsewhere:
            self.running.pop(agent_id, None)
            return
        if agent.stop_reason is not None:
            self.running.pop(agent_id, None)
            await self._terminate(agent, "stopped", summary=agent.stop_reason)
            return
        agent.task = asyncio.create_task(self._run(agent), name=f"agent-{agent_id}")

    async def _fresh(self, admitted: Recorded, status: StatusEvent) -> FreshAgent | None:
        """What the projection knows of the agent whose spawn is admitted, once it has folded
        the log up to the admission (None: it does not know that spawn, or is too far
        behind)."""
        if not await self.runner.reached(admitted.seq, FRESH_WAIT_S):
            return None
        return self.fresh.get(status.agent_id, status.causation_id)

    async def _instance_from_log(
        self, agent_id: str, admitted: Recorded, status: StatusEvent, kind: StartKind
    ) -> RunningAgent | None:
        """The instance an admission starts, from reads of the log (None: it starts nothing)."""
        # Independent reads, in one round trip; the agent's first status is read on the guess
        # that it never ended (a first start), where the search for a `started` begins.
        last_end, origin, first_status = await asyncio.gather(
            self.log.get_last(subject_for("terminate", agent_id)),
            self._origin(agent_id),
            self.log.get_next(subject_for("status", agent_id), 1),
        )
        end_seq = None if last_end is None else last_end.seq
        if not start_allowed(kind, admitted.seq, end_seq):
            log.info("admission of %s at seq %s starts nothing (%s)", agent_id, admitted.seq, kind)
            return None
        first = first_status if end_seq is None else None
        if await self._started_since(agent_id, end_seq or 0, admitted.seq, first):
            log.info("%s has started already; admission at seq %s ignored", agent_id, admitted.seq)
            return None
        return await self._instance(status, kind, last_end, origin)

    async def _instance(
        self,
        status: StatusEvent,
        kind: StartKind,
        last_end: RawRecord | None,
        origin: Origin | None,
    ) -> RunningAgent | None:
        """The instance an admission starts, from the agent's origin and its last end."""
        agent_id = status.agent_id
        if origin is None:
            log.error("admitted agent %s has no spawn or fork event; ignoring", agent_id)
            return None
        spawn = origin.spawn
        agent = RunningAgent(
            spawn=spawn,
            tree_id=status.tree_id or spawn.tree_id or agent_id,
            start=kind,
            fork=origin.fork,
            source_session=origin.source_session,
            terminate_guard=0 if last_end is None else last_end.seq,
        )
        if kind == "resume":
            agent.message = await self._resume_message(status, agent)
            ended = _decode(last_end)
            if isinstance(ended, TerminateEvent):
                agent.tokens_before = ended.usage.tokens
        elif origin.fork is not None:
            agent.message = origin.fork.initial_message
        return agent

    async def _check_stopped(self, agent: RunningAgent) -> None:
        """Note a stop asked for before the instance started (after its last end)."""
        raw = await self.log.get_last(subject_for("control", agent.spawn.agent_id))
        control = _decode(raw)
        if (
            raw is not None
            and isinstance(control, ControlEvent)
            and control.action == "stop"
            and raw.seq > agent.terminate_guard
        ):
            agent.stop_reason = agent.stop_reason or control.reason or "stopped"

    async def _started_since(
        self, agent_id: str, after_seq: int, admitted_seq: int, first: RawRecord | None = None
    ) -> bool:
        """Whether a `started` status of the agent is in the log between its last end and this
        admission (one after the admission makes the guarded `started` append lose anyway).
        `first`, when given, is the agent's first status after `after_seq`, already read."""
        subject = subject_for("status", agent_id)
        seq = after_seq + 1
        raw: RawRecord | None
        while seq < admitted_seq:
            if first is not None:
                raw, first = first, None
            else:
                raw = await self.log.get_next(subject, seq)
            if raw is None or raw.seq >= admitted_seq:
                return False
            event = _decode(raw)
            if isinstance(event, StatusEvent) and event.status_type == "started":
                return True
            seq = raw.seq + 1
        return False

    async def _first_spawn(self, agent_id: str) -> SpawnEvent | None:
        """The agent's first valid spawn: the one the governor admits (a later spawn of the
        agent changes nothing; it may ask for another runtime or more permissions)."""
        subject = subject_for("spawn", agent_id)
        seq = 1
        for _ in range(MAX_SPAWNS_READ):
            raw = await self.log.get_next(subject, seq)
            if raw is None:
                return None
            spawn = _decode(raw)
            if isinstance(spawn, SpawnEvent):
                return spawn
            seq = raw.seq + 1  # an invalid message, dead-lettered: the governor skipped it too
        return None

    async def _origin(self, agent_id: str, depth: int = 0) -> Origin | None:
        """The spawn an agent runs as, following a fork back to its source's spawn."""
        spawn = await self._first_spawn(agent_id)
        if spawn is not None:
            return Origin(spawn)
        fork = _decode(await self.log.get_last(subject_for("fork", agent_id)))
        if not isinstance(fork, ForkEvent) or depth >= MAX_FORK_DEPTH:
            return None
        source = await self._origin(fork.source_agent, depth + 1)
        if source is None:
            log.error("fork %s: its source %s has no spawn or fork", agent_id, fork.source_agent)
            return None
        return Origin(
            fork_spawn(fork, source.spawn),
            fork,
            fork.source_session or source.spawn.session_id or fork.source_agent,
        )

    async def _resume_message(self, status: StatusEvent, agent: RunningAgent) -> str | None:
        """The message a resume brings: from the admission, else from the `control resume`."""
        message = status.payload.details.get("message")
        if isinstance(message, str):
            return message
        raw = await self.log.get_last(subject_for("control", agent.spawn.agent_id))
        control = _decode(raw)
        if (
            raw is not None
            and isinstance(control, ControlEvent)
            and control.action == "resume"
            and raw.seq > agent.terminate_guard
        ):
            return control.message
        return None

    # -- running -----------------------------------------------------------------------------

    async def _run(self, agent: RunningAgent) -> None:
        agent.began = True
        if agent.stop_reason is not None or agent.ended_elsewhere:
            # Stopped, or ended elsewhere, after the task was made and before its first step
            # (see `_interrupt`): it ends the way a cancelled run does.
            await self._end_cancelled(agent, agent.tokens_before)
            return
        spawn = agent.spawn
        context: AgentContext | None = None
        try:
            session = await self._open_session(agent)
            context = AgentContext(
                self.log,
                spawn,
                agent.tree_id,
                session=session,
                start=agent.start,
                resume_message=agent.message if agent.start == "resume" else None,
                tokens=agent.tokens_before,
            )
            run = AgentRun(
                spawn=spawn,
                context=context,
                session=session,
                env={
                    "GROVE_AGENT_ID": spawn.agent_id,
                    "GROVE_TREE_ID": agent.tree_id,
                    "GROVE_NATS_URL": self.agent_nats_url,
                    **self.agent_credentials,
                },
                start=agent.start,
                message=agent.message,
                workspace=self.workspace,
            )
            agent.run = run
            if self.paused:
                await self._pause(agent, "the system is paused")
            runtime = await self.runtimes.get(spawn.config.runtime)
            if runtime is None:
                outcome = Outcome(
                    completed=False,
                    error=f"runtime {spawn.config.runtime!r} is not available in this spawner "
                    f"(available: {', '.join(self.runtimes.names)})",
                )
            else:
                outcome = await runtime.run(run)
        except asyncio.CancelledError:
            tokens = context.tokens if context is not None else agent.tokens_before
            await self._end_cancelled(agent, tokens)
            return
        except Exception as exc:
            log.exception("runtime crashed for %s", spawn.agent_id)
            outcome = Outcome(completed=False, error=f"runtime error: {exc!r}")
        finally:
            self._forget(agent)
        agent.ending = True
        if agent.abandoned:
            log.warning("%s: its abandoned run ended at last; its end was appended", spawn.agent_id)
            return
        tokens = max(outcome.tokens, context.tokens if context is not None else 0)
        if tokens > agent.tokens_before:
            metrics.TOKENS_USED.labels(spawn.config.runtime).inc(tokens - agent.tokens_before)
        if outcome.completed:
            if not (agent.reported_end or (context is not None and context.reported_end)):
                await self._report_silent_completion(agent, outcome, tokens)
            await self._terminate(agent, "completed", summary=outcome.summary, tokens=tokens)
        else:
            metrics.RUNTIME_ERRORS.labels(spawn.config.runtime).inc()
            await self._report_failure(agent, outcome, tokens)
            await self._terminate(agent, "failed", error=outcome.error, tokens=tokens)

    async def _end_cancelled(self, agent: RunningAgent, tokens: int) -> None:
        """End a stopped run: `stopped` on the log, unless its end was decided elsewhere."""
        agent.ending = True
        self._forget(agent)
        if not agent.ended_elsewhere:
            await self._terminate(
                agent, "stopped", summary=agent.stop_reason or "stopped", tokens=tokens
            )

    def _forget(self, agent: RunningAgent) -> None:
        """No longer count this instance as running (a newer one of the agent may be)."""
        if self.running.get(agent.spawn.agent_id) is agent:
            del self.running[agent.spawn.agent_id]

    async def _open_session(self, agent: RunningAgent) -> StoredSession:
        spawn = agent.spawn
        entries = await self.opener.open(
            SessionOpen(
                agent.start,
                spawn,
                datetime.now(UTC),
                fork=agent.fork,
                source_session=agent.source_session,
                resume_message=agent.message if agent.start == "resume" else None,
            )
        )
        return StoredSession(
            self.sessions, spawn.session_id or spawn.agent_id, spawn.agent_id, entries
        )

    def _status(
        self,
        agent: RunningAgent,
        status_type: str,
        summary: str = "",
        details: dict[str, Any] | None = None,
    ) -> StatusEvent:
        spawn = agent.spawn
        return StatusEvent(
            event_id=new_id(),
            agent_id=spawn.agent_id,
            session_id=spawn.session_id,
            tree_id=agent.tree_id,
            timestamp=datetime.now(UTC),
            causation_id=spawn.event_id,
            status_type=status_type,
            payload=StatusPayload(summary=summary, details=details or {}),
        )

    async def _report_silent_completion(
        self, agent: RunningAgent, outcome: Outcome, tokens: int
    ) -> None:
        """The run ended well but the agent did not say so here: say it for the agent, unless
        it said `completed` or `failed` itself on another path (its own connection).

        The notice is appended guarded by the newest status of the agent the spawner knows of
        (`started`, or one its projection folded since), so that in the usual case nothing is
        read first. When the guard loses, the agent's newest status is read: an end of this
        instance stands (the agent's own, or this notice stored by an append whose
        acknowledgement was lost), and any other status is the next guard.
        """
        text, _ = cut_to_budget(outcome.summary, min(agent.spawn.config.return_budget, 500))
        details: dict[str, Any] = {"system_notice": "silent_completion"}
        if tokens:
            details["tokens"] = tokens
        notice = self._status(agent, "completed", text, details)
        subject = subject_for("status", agent.spawn.agent_id)
        expect = agent.status_seq
        while True:
            try:
                await self._append_until_stored(notice, expect_last_seq=expect)
            except ConcurrencyConflict:
                COMPLETION_GUARDS_LOST.inc()
            else:
                return
            newest = await self._read_until_answered(subject)
            if newest is None:  # the agent's statuses were removed from the log
                expect = 0
                continue
            status = _decode(newest)
            if (
                newest.seq > agent.started_seq
                and isinstance(status, StatusEvent)
                and status.status_type in END_STATUSES
            ):
                return
            expect = newest.seq

    async def _report_failure(self, agent: RunningAgent, outcome: Outcome, tokens: int) -> None:
        """The `failed` status: the error, what was attempted and the partial results, each
        within the agent's return budget (the newest kept, `truncated` when cut): the parent
        reads them, and a message on the log has a size limit (a failure that printed
        megabytes is still reported, and the agent still ends)."""
        budget = agent.spawn.config.return_budget
        attempted, attempted_cut = newest_within_budget(outcome.attempted, budget)
        partial, partial_cut = newest_within_budget(outcome.partial_results, budget)
        error = outcome.error
        details: dict[str, Any] = {
            "error": cut_to_budget(error, budget)[0] if error is not None else None,
            "attempted": attempted,
            "partial_results": partial,
        }
        if attempted_cut or partial_cut:
            details["truncated"] = True
        if tokens:
            details["tokens"] = tokens
        await self._append_until_stored(
            self._status(agent, "failed", (outcome.error or "failed")[:500], details)
        )

    async def _read_until_answered(self, subject: str) -> RawRecord | None:
        """The last message on `subject`, asked again while the log does not answer (the
        agent's end waits on it: a restarting nats-server must not lose the end)."""
        pause = TERMINATE_RETRY_S
        while True:
            try:
                return await self.log.get_last(subject)
            except (nats.errors.Error, LogError, OSError) as exc:
                TERMINATE_RETRIES.inc()
                log.warning("reading %s failed, retrying in %gs: %r", subject, pause, exc)
                await asyncio.sleep(pause)
                pause = min(pause * 2, TERMINATE_RETRY_MAX_S)

    async def _append_until_stored(
        self, event: Event, *, expect_last_seq: int | None = None
    ) -> None:
        """Append an agent's end (its last status, its terminate) however long the log refuses:
        full or unreachable, the same event is tried again (stored once), because a parent
        waits for it. A lost guard (ConcurrencyConflict) is the caller's to handle."""
        pause = TERMINATE_RETRY_S
        while True:
            try:
                await self.log.append(event, expect_last_seq=expect_last_seq)
            except ConcurrencyConflict:
                raise
            except LogError as exc:
                TERMINATE_RETRIES.inc()
                log.warning(
                    "%s: %s not appended, retrying in %gs: %s",
                    event.agent_id,
                    event.type,
                    pause,
                    exc,
                )
                await asyncio.sleep(pause)
                pause = min(pause * 2, TERMINATE_RETRY_MAX_S)
            else:
                return

    async def _terminate(
        self,
        agent: RunningAgent,
        reason: str,
        *,
        summary: str = "",
        error: str | None = None,
        tokens: int = 0,
    ) -> None:
        spawn = agent.spawn
        text, truncated = cut_to_budget(summary, spawn.config.return_budget)
        artifact_id = None
        if truncated:
            artifact_id, error = await self._store_result(agent, summary, error)
        runtime_s = time.monotonic() - agent.started_at if agent.started_at else 0.0
        end = TerminateEvent(
            event_id=new_id(),
            agent_id=spawn.agent_id,
            session_id=spawn.session_id,
            tree_id=agent.tree_id,
            timestamp=datetime.now(UTC),
            causation_id=spawn.event_id,
            reason=reason,
            result=ResultSummary(summary=text, artifact=artifact_id, truncated=truncated),
            error=error,
            usage=Usage(tokens=tokens, runtime_s=round(runtime_s, 6)),
        )
        try:
            await self._append_until_stored(end, expect_last_seq=agent.terminate_guard)
        except ConcurrencyConflict:
            log.info("%s was already terminated", spawn.agent_id)

    async def _store_result(
        self, agent: RunningAgent, result: str, error: str | None
    ) -> tuple[str | None, str | None]:
        """The return contract: a result over the budget is stored whole as an artifact of the
        agent (through the artifact-store), and the terminate carries its handle. When the
        store refuses or stays silent, the agent still ends, with a note in `error`."""
        agent_id = agent.spawn.agent_id
        try:
            artifact = await store_result(
                self.log, agent_id, result, after_seq=agent.started_seq or None
            )
        except ArtifactError as exc:
            log.warning("%s: full result not stored: %s", agent_id, exc)
            note = (
                f"the full result ({len(result)} characters) could not be stored as an "
                f"artifact ({exc}); the summary is cut to the return budget"
            )
            return None, note if error is None else f"{error}; {note}"
        return artifact.artifact_id, error

    # -- live reactions ----------------------------------------------------------------------

    async def _after_event(self, recorded: Recorded, live: bool) -> None:
        self.fresh.fold(recorded)
        event = recorded.event
        if isinstance(event, StatusEvent):
            if event.status_type == "admitted" and live:
                self._admission_folded(recorded, event)
            spawner_id = event.payload.details.get(SPAWNER_ID_DETAIL)
            if event.status_type == "started" and isinstance(spawner_id, str):
                self.peers.hear(spawner_id, time.monotonic())
            agent = self.running.get(event.agent_id)
            if agent is not None and recorded.seq > agent.status_seq and agent.started_seq > 0:
                agent.status_seq = recorded.seq
                if event.status_type in END_STATUSES:
                    agent.reported_end = True
        elif isinstance(event, ControlEvent):
            if event.action == "pause_all":
                self.paused = True
                if live:
                    await self._pause_all(event)
            elif event.action == "resume_all":
                self.paused = False
                if live:
                    await self._resume_all()
            elif event.action == "stop" and live:
                self._stop(event)
        elif isinstance(event, TerminateEvent) and live:
            agent = self.running.get(event.agent_id)
            if agent is not None and recorded.seq > agent.terminate_guard:
                log.info(
                    "%s ended elsewhere (%s); cancelling its run", event.agent_id, event.reason
                )
                agent.ended_elsewhere = True
                self._cancel(agent)

    def _stop(self, control: ControlEvent) -> None:
        agent = self.running.get(control.agent_id)
        if agent is None or agent.stop_reason is not None:
            return
        agent.stop_reason = control.reason or "stopped"
        self._cancel(agent)

    @staticmethod
    def _interrupt(agent: RunningAgent) -> bool:
        """Cancel the agent's run where a cancellation ends it as stopped; False when it was
        not cancelled. A run whose task has not taken its first step is left to see the stop
        itself (cancelled then, the task would end without running `_run` at all, and no end
        would be appended), and a run appending its end is left to finish that append."""
        task = agent.task
        if task is None or task.done() or not agent.began or agent.ending:
            return False
        task.cancel()
        return True

    def _cancel(self, agent: RunningAgent) -> None:
        """Cancel the agent's run, and make sure it ends.

        One cancellation is not always enough: `asyncio.wait_for` before Python 3.12 (nats-py's
        request uses it) drops a cancellation that arrives together with the result it waits
        for, and agent code may catch one. A run still going after a cleanup's time is
        cancelled again, every second; after `stop_grace` its end is appended regardless.
        """
        if not self._interrupt(agent):
            return
        task = agent.task
        assert task is not None
        if agent.canceller is None:
            agent.canceller = asyncio.create_task(
                self._insist_on_cancel(agent, task), name=f"cancel-{agent.spawn.agent_id}"
            )

    async def _insist_on_cancel(self, agent: RunningAgent, task: asyncio.Task[None]) -> None:
        agent_id = agent.spawn.agent_id
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.stop_grace
        wait = RECANCEL_AFTER_S
        while True:
            done, _ = await asyncio.wait([task], timeout=min(wait, deadline - loop.time()))
            if done or agent.ending:
                return  # ended, or appending its end
            if loop.time() >= deadline:
                break
            log.warning("%s: its run did not end when cancelled; cancelling it again", agent_id)
            RECANCELS.inc()
            task.cancel()
            wait = RECANCEL_EVERY_S
        log.error(
            "%s: its run ignored cancellation for %gs; appending its end regardless",
            agent_id,
            self.stop_grace,
        )
        agent.abandoned = True
        self._forget(agent)
        if not agent.ended_elsewhere:
            reason = agent.stop_reason or "stopped"
            await self._terminate(
                agent, "stopped", summary=f"{reason} (its run did not end when cancelled)"
            )

    async def _pause(self, agent: RunningAgent, summary: str, by: str | None = None) -> None:
        if agent.run is None or not agent.run.pause():
            return
        details: dict[str, Any] = {SPAWNER_ID_DETAIL: self.spawner_id}
        if by is not None:
            details["by"] = by
        await self.log.append(self._status(agent, "paused", summary, details))

    async def _pause_all(self, control: ControlEvent) -> None:
        summary = "paused: " + (control.reason or f"pause_all by {control.agent_id}")
        for agent in list(self.running.values()):
            await self._pause(agent, summary, control.agent_id)

    async def _resume_all(self) -> None:
        for agent in list(self.running.values()):
            if agent.run is not None and agent.run.resume():
                await self.log.append(
                    self._status(
                        agent,
                        "resumed",
                        "resumed after a pause",
                        {"from": "pause", SPAWNER_ID_DETAIL: self.spawner_id},
                    )
                )

    # -- heartbeats and lost peers -----------------------------------------------------------

    async def heartbeat(self) -> None:
        """Tell the peers this spawner is alive, and which agents it runs, every interval."""
        while True:
            await self._beat()
            await asyncio.sleep(self.heartbeat_interval)

    async def _beat(self) -> None:
        body = {
            "spawner_id": self.spawner_id,
            "agents": sorted(self.running),
            "time": datetime.now(UTC).isoformat(),
            "takes_admissions": self.takes_admissions,
        }
        try:
            await self.log.nc.publish(HEARTBEAT_SUBJECT, json.dumps(body).encode())
        except Exception as exc:  # noqa: BLE001 - a missed beat is retried next interval
            log.debug("heartbeat not sent: %r", exc)

    async def heard(self, heartbeat: dict[str, Any]) -> dict[str, Any]:
        """A peer's heartbeat (`grove.rpc.spawner.heartbeat`, served through FastStream)."""
        spawner_id = heartbeat.get("spawner_id")
        if isinstance(spawner_id, str):
            now = time.monotonic()
            self.peers.hear(spawner_id, now)
            if heartbeat.get("takes_admissions") is False:
                # Shutting down: its agents still beat on, its admissions are the others'.
                self.beats.forget(spawner_id)
                return {}
            if spawner_id not in self.sharing(now):
                # A peer that just came (or came back) has not heard this spawner yet: a beat
                # now, so that both share the admissions from its start, not an interval on.
                beat = asyncio.create_task(self._beat())
                self._out_of_turn.add(beat)
                beat.add_done_callback(self._out_of_turn.discard)
            self.beats.hear(spawner_id, now)
        return {}

    async def watch_peers(self) -> None:
        """End the agents of a peer whose heartbeats (see `heard`) stopped."""
        await self.runner.caught_up.wait()
        while True:
            await asyncio.sleep(min(1.0, self.spawner_timeout / 5))
            try:
                await self.fail_lost_peers()
            except Exception:
                log.exception("could not end the agents of a lost spawner; will retry")

    async def fail_lost_peers(self) -> None:
        """End, as failed, the agents of every peer silent for longer than the timeout."""
        now = time.monotonic()
        lost = self.peers.lost(self.runner.state, now, self.spawner_timeout, self.spawner_id)
        for spawner_id, agents in lost.items():
            silent = self.peers.silent_for(spawner_id, now)
            error = f"spawner {spawner_id} lost (no heartbeat for {silent:.0f}s)"
            for started in agents:
                if self._ended_lost.get(started.agent_id) == started.started_seq:
                    continue
                self._ended_lost[started.agent_id] = started.started_seq
                if await self._terminate_lost(started, error):
                    LOST_AGENTS.labels("peer").inc()

    async def _on_caught_up(self) -> None:
        self.peers.since = time.monotonic()
        await self.fail_lost_agents()
        self.look_over_admissions(time.monotonic())

    async def fail_lost_agents(self) -> None:
        """After a restart: agents this spawner started before are gone; say so."""
        error = f"spawner {self.spawner_id} restarted; the agent's run was lost"
        for started in self.runner.state.started_by(self.spawner_id):
            if started.agent_id in self.running:
                continue
            if await self._terminate_lost(started, error):
                LOST_AGENTS.labels("restart").inc()

    async def _terminate_lost(self, started: StartedAgent, error: str) -> bool:
        """End a lost instance as failed, unless it has ended; False when it had."""
        last = await self.log.get_last(subject_for("terminate", started.agent_id))
        if last is not None and last.seq > started.started_seq:
            return False
        try:
            await self.log.append(
                TerminateEvent(
                    event_id=new_id(),
                    agent_id=started.agent_id,
                    session_id=started.session_id,
                    tree_id=started.tree_id,
                    timestamp=datetime.now(UTC),
                    reason="failed",
                    result=ResultSummary(summary=error),
                    error=error,
                ),
                expect_last_seq=0 if last is None else last.seq,
            )
        except ConcurrencyConflict:
            return False
        log.warning("%s: %s", started.agent_id, error)
        return True

    async def shutdown(self) -> None:
        """Start no further admission, let the starts begun finish, then stop every running
        agent (they end as stopped). What was not started waits in the log for a peer, or
        for this spawner's next start."""
        self.takes_admissions = False
        await self._beat()  # the peers take this spawner's share of the admissions now
        if self._start_tasks:
            await asyncio.wait(list(self._start_tasks), timeout=START_DRAIN_S)
        for agent in list(self.running.values()):
            if agent.task is not None:
                agent.stop_reason = agent.stop_reason or f"spawner {self.spawner_id} shut down"
                self._interrupt(agent)
        tasks = [a.task for a in self.running.values() if a.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=10)


def agent_credentials(settings: SpawnerSettings) -> dict[str, str]:
    """The GROVE_NATS_* variables agent processes connect with."""
    out: dict[str, str] = {}
    if settings.agent_nats_user:
        out["GROVE_NATS_USER"] = settings.agent_nats_user
        out["GROVE_NATS_PASSWORD"] = settings.agent_nats_password or ""
    if settings.agent_nats_creds:
        out["GROVE_NATS_CREDS"] = str(settings.agent_nats_creds)
    return out


async def setup(service: Service) -> None:
    """Start a spawner inside a service process."""
    assert service.log is not None
    settings = (
        service.settings if isinstance(service.settings, SpawnerSettings) else SpawnerSettings()
    )
    store = ProjectionStore(settings.database_for(f"spawner-{settings.spawner_id}"))
    sessions = SessionStore(sessions_database_url(settings), settings.session_sync)
    spawner = Spawner(
        service.log,
        store,
        settings.spawner_id,
        settings.nats_url,
        sessions=sessions,
        heartbeat_interval=settings.heartbeat_interval,
        spawner_timeout=settings.spawner_timeout,
        stop_grace=settings.stop_grace,
        workspace=settings.workspace,
        agent_credentials=agent_credentials(settings),
    )
    service.ready_checks.append(spawner.runner.ready)
    heartbeats = RpcServer(NAME, {"heartbeat": spawner.heard})
    service.ready_checks.append(heartbeats.is_serving)
    await service.serve_rpc(heartbeats)
    service.spawn(spawner.heartbeat(), "spawner-heartbeat")
    service.spawn(spawner.runner.run(), "spawner-projection")
    service.spawn(spawner.watch_peers(), "spawner-peers")
    service.spawn(spawner.watch_admissions(), "spawner-admissions")
    service.on_stop.append(spawner.shutdown)


def main() -> None:
    """`python -m grove_spawner`."""
    run_service(NAME, setup, SpawnerSettings())

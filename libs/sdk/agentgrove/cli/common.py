"""What every `grove` command shares: the connection, reading the log, formatting, options.

Every command talks to AgentGrove only through NATS. Errors a user can cause end in one line
on stderr (`grove: error: ...`) and a non-zero exit code.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NoReturn, TypeAlias, TypeVar

import nats.errors
import nats.js.errors

from agentgrove.client import GroveClient, UnknownAgent, discover_url
from grove_core.log import EventLog, LogError
from grove_core.records import RawRecord, Recorded, decode_record, is_deadletter
from grove_core.tree import AgentNode, TreeState, evolve
from grove_events import (
    ArtifactEvent,
    ControlEvent,
    Event,
    ForkEvent,
    HitlEvent,
    InvalidEvent,
    MessageEvent,
    SpawnEvent,
    StatusEvent,
    TerminateEvent,
    to_dict,
)
from grove_events.envelope import TOKEN_PATTERN

T = TypeVar("T")

ALL_SUBJECTS = "grove.>"
DEFAULT_DATA_DIR = ".grove"
#: Seconds a connection attempt may take before the command gives up.
CONNECT_TIMEOUT_S = 2.0

#: A stored message, decoded when it is a valid event.
Item = tuple[RawRecord, Recorded | InvalidEvent]


class CliError(Exception):
    """An error the user can act on; printed as one line, exit code 1."""


class Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line on stderr."""

    def error(self, message: str) -> NoReturn:
        """Print `grove: error: ...` with a pointer to --help, exit 2."""
        self.exit(2, f"grove: error: {message} (see `{self.prog} --help`)\n")


# -- connecting ---------------------------------------------------------------------------------


@dataclass
class Connection:
    """A client connection that fails fast, and notices when it is lost."""

    client: GroveClient
    url: str
    closed: asyncio.Event

    @property
    def log(self) -> EventLog:
        """The event log behind the client."""
        return self.client.log

    async def guard(self, work: Awaitable[T]) -> T:
        """Await `work`; fail with a clear error if the connection is lost meanwhile."""
        task = asyncio.ensure_future(work)
        lost = asyncio.ensure_future(self.closed.wait())
        try:
            await asyncio.wait({task, lost}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            lost.cancel()
            if not task.done():
                task.cancel()
            await asyncio.gather(task, lost, return_exceptions=True)
        if not task.cancelled():
            return task.result()
        raise CliError(f"lost the connection to NATS at {self.url}")


@contextlib.asynccontextmanager
async def connect(url: str) -> AsyncIterator[Connection]:
    """Connect to NATS at `url` without retrying: a missing server is an error within seconds."""
    closed = asyncio.Event()

    async def on_closed() -> None:
        closed.set()

    async def on_error(_: Exception) -> None:
        return None

    client = await GroveClient.connect(
        url,
        connect_timeout=CONNECT_TIMEOUT_S,
        reachable_within=CONNECT_TIMEOUT_S,
        allow_reconnect=False,
        # nats-py's server selection treats 0 attempts as "no limit"; 1 gives up after a retry.
        max_reconnect_attempts=1,
        reconnect_time_wait=0.1,
        closed_cb=on_closed,
        error_cb=on_error,
    )
    try:
        yield Connection(client, url, closed)
    finally:
        await client.close()


async def reachable(url: str) -> bool:
    """Whether a NATS server answers at `url`."""
    try:
        async with connect(url):
            return True
    except LogError:
        return False


async def tip(log: EventLog) -> int:
    """The sequence of the newest message in the log."""
    try:
        return await log.last_seq()
    except nats.js.errors.NotFoundError:
        raise CliError(
            f"the NATS server has no {log.stream} stream; start the stack with `grove up`"
        ) from None


async def require_agent(client: GroveClient, agent_id: str) -> None:
    """Raise UnknownAgent unless the log names `agent_id`."""
    if not await client.exists(agent_id):
        raise UnknownAgent(agent_id)


# -- reading the log ------------------------------------------------------------------------------


def decode_item(record: RawRecord) -> Item:
    """A stored message with its decoded event, or with why it is not a valid one."""
    try:
        return record, decode_record(record)
    except InvalidEvent as exc:
        return record, exc


async def records(
    log: EventLog,
    from_seq: int,
    *,
    subjects: str = ALL_SUBJECTS,
    follow: bool = False,
    since: datetime | None = None,
) -> AsyncIterator[Item]:
    """Stored messages from `from_seq` (dead letters left out), to the tip or, with `follow`, on.

    `since` leaves out the messages the stream stored before that time.
    """
    until: int | None = None
    if not follow:
        until = await _last_on(log, subjects)
        if until < from_seq:
            return
    async for record in log.read(from_seq, subjects=subjects, until_seq=until, follow=follow):
        if is_deadletter(record.subject):
            continue
        if since is not None and record.timestamp < since:
            continue
        yield decode_item(record)


async def _last_on(log: EventLog, subjects: str) -> int:
    # A replay of a subset must end at the subset's own newest message, not at the tip.
    if subjects == ALL_SUBJECTS:
        return await tip(log)
    await tip(log)
    last = await log.get_last(subjects)
    return 0 if last is None else last.seq


async def fold_tree(log: EventLog) -> TreeState:
    """The agent tree, folded from a replay of the whole log."""
    state = TreeState()
    async for _, item in records(log, 1):
        if isinstance(item, Recorded):
            state = evolve(state, item)
    return state


# -- formatting -----------------------------------------------------------------------------------


def clip(text: str, width: int) -> str:
    """`text` on one line, cut to `width` characters."""
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: max(width - 3, 0)] + "..."


def short_id(agent_id: str) -> str:
    """A short form of an agent id: the random tail of a UUIDv7, or a short id as it is."""
    return agent_id if len(agent_id) <= 12 else agent_id[-8:]


def format_time(value: datetime) -> str:
    """A UTC time with milliseconds, ISO 8601."""
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def describe(event: Event) -> str:
    """What an event says, in a few words."""
    match event:
        case SpawnEvent():
            parent = f" parent={short_id(event.parent)}" if event.parent else ""
            return f"{event.config.runtime}{parent} task={clip(event.task, 60)!r}"
        case StatusEvent():
            summary = event.payload.summary
            return event.status_type + (f": {clip(summary, 80)}" if summary else "")
        case TerminateEvent():
            text = event.result.summary
            out = event.reason + (f": {clip(text, 80)}" if text else "")
            return out + (f" error: {clip(event.error, 80)}" if event.error else "")
        case ControlEvent():
            note = event.reason or event.message or ""
            return event.action + (f": {clip(note, 80)}" if note else "")
        case ForkEvent():
            return f"from {short_id(event.source_agent)}: {clip(event.reason, 60)}"
        case MessageEvent():
            target = short_id(event.to) if event.to else f"topic:{event.topic}"
            return f"to {target}: {clip(event.content, 60)}"
        case HitlEvent():
            said = (event.prompt if event.action == "request" else event.answer) or ""
            return f"{event.action} {short_id(event.request_id)}: {clip(said, 60)}"
        case ArtifactEvent():
            return f"{event.name} ({event.size} bytes, {event.media_type})"
    return ""


def format_line(item: Item) -> str:
    """One stored message as one human-readable line."""
    record, decoded = item
    if isinstance(decoded, InvalidEvent):
        when = format_time(record.timestamp)
        return f"{record.seq:>6}  {when}  INVALID    {record.subject}: {clip(decoded.reason, 100)}"
    event = decoded.event
    when = format_time(event.timestamp or record.timestamp)
    return (
        f"{record.seq:>6}  {when}  {event.type:<9}  {short_id(event.agent_id):<12}  "
        f"{describe(event)}"
    )


def format_json(item: Item) -> str:
    """One stored message as one JSON line: its seq, subject, and the event or the error."""
    record, decoded = item
    out: dict[str, Any] = {"seq": record.seq, "subject": record.subject}
    if isinstance(decoded, InvalidEvent):
        out["invalid"] = decoded.reason
        out["data"] = record.data.decode("utf-8", errors="replace")
    else:
        out["event"] = to_dict(decoded.event)
    return json.dumps(out)


def node_line(node: AgentNode, depth: int) -> str:
    """One agent of the tree on one line, indented by its depth."""
    line = f"{'  ' * depth}{node.agent_id}  [{node.state}]  {clip(node.task, 50)}"
    if node.summary:
        line += f"  -> {clip(node.summary, 70)}"
    if node.error:
        line += f"  error: {clip(node.error, 90)}"
    return line


def tree_lines(state: TreeState, top: AgentNode, depth: int = 0) -> Iterator[str]:
    """The lines of `top` and its descendants, depth first."""
    yield node_line(top, depth)
    for child in top.children:
        node = state.agents.get(child)
        if node is not None:
            yield from tree_lines(state, node, depth + 1)


def tree_json(state: TreeState, top: AgentNode) -> dict[str, Any]:
    """`top` and its descendants as nested JSON."""
    out = asdict(top)
    out["children"] = [tree_json(state, state.agents[c]) for c in top.children if c in state.agents]
    return out


def tops(state: TreeState, agent_id: str | None) -> list[AgentNode]:
    """The nodes to show: one agent's, or every root."""
    if agent_id is None:
        return state.roots()
    node = state.agents.get(agent_id)
    if node is None:
        raise UnknownAgent(agent_id)
    return [node]


def render_tree(state: TreeState, nodes: list[AgentNode]) -> str:
    """The tree under `nodes` as text."""
    lines = [line for node in nodes for line in tree_lines(state, node)]
    return "\n".join(lines) if lines else "(no agents in the log)"


def out(text: str = "") -> None:
    """Print a line now (output is often a pipe)."""
    print(text, flush=True)


# -- options --------------------------------------------------------------------------------------


def nats_url(args: argparse.Namespace) -> str:
    """The URL to use: --nats-url, GROVE_NATS_URL, or what `grove up` wrote in the data folder."""
    explicit: str | None = args.nats_url
    return explicit or discover_url(args.data_dir)


def data_dir(args: argparse.Namespace) -> Path:
    """The data folder: --data-dir, GROVE_DATA_DIR, or ./.grove."""
    given: Path | None = args.data_dir
    return given or Path(os.environ.get("GROVE_DATA_DIR", DEFAULT_DATA_DIR))


def agent_id(value: str) -> str:
    """An argparse type: an agent id (letters, digits, '-' or '_')."""
    if not TOKEN_PATTERN.fullmatch(value):
        raise argparse.ArgumentTypeError(
            f"{value!r} is not an agent id (1-128 letters, digits, '-' or '_')"
        )
    return value


def positive_int(value: str) -> int:
    """An argparse type: an integer of at least 1."""
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return number


def positive_float(value: str) -> float:
    """An argparse type: a number of seconds above 0."""
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
    if not number > 0:
        raise argparse.ArgumentTypeError(f"{value} must be above 0")
    return number


def iso_time(value: str) -> datetime:
    """An argparse type: an ISO 8601 time; without a zone, local time."""
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not an ISO 8601 time (e.g. 2025-01-31T12:00:00Z)"
        ) from None
    return parsed if parsed.tzinfo is not None else parsed.astimezone()


Handler = Callable[[argparse.Namespace], int]
Subcommands: TypeAlias = "argparse._SubParsersAction[Parser]"


def run_async(command: Callable[[argparse.Namespace], Coroutine[Any, Any, int]]) -> Handler:
    def run(args: argparse.Namespace) -> int:
        return asyncio.run(command(args))

    return run

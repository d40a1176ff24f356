"""Replay debugging: the tree as it stood at a point, what changed between two points, and
moving a captured log into another stack (`grove export` / `grove import`).

A point of the log is a stream sequence (`120`) or a time (`2026-01-31T12:00:00Z`): the point
of a time is the last message the stream stored at or before it.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import IO, Any

from agentgrove.cli.common import (
    ALL_SUBJECTS,
    CliError,
    Connection,
    Item,
    Parser,
    Subcommands,
    agent_id,
    connect,
    data_dir,
    format_json,
    format_line,
    format_time,
    nats_url,
    out,
    reachable,
    records,
    render_tree,
    require_agent,
    run_async,
    short_id,
    tip,
    tops,
    tree_json,
)
from agentgrove.client import UnknownAgent
from agentgrove.routing import RouterError
from grove_core.log import EventLog
from grove_core.natsserver import LocalNatsServer
from grove_core.records import Recorded
from grove_core.tree import AgentNode, TreeState, evolve
from grove_events import STREAM_NAME

#: A point of the log: a stream sequence or a time.
Point = int | datetime
#: Headers that guarded the original append; a copy must not carry them.
GUARD_HEADER_PREFIX = "Nats-Expected-"
#: Messages published before waiting for their acknowledgements, on import.
IMPORT_WINDOW = 1000
#: How often long exports and imports report progress (messages).
PROGRESS_EVERY = 10_000


def log_point(value: str) -> Point:
    """An argparse type: a stream sequence (a whole number >= 1) or an ISO 8601 time."""
    if value.isdigit():
        number = int(value)
        if number < 1:
            raise argparse.ArgumentTypeError("a sequence must be at least 1")
        return number
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is neither a sequence number nor an ISO 8601 time "
            "(e.g. 120 or 2026-01-31T12:00:00Z)"
        ) from None
    return parsed if parsed.tzinfo is not None else parsed.astimezone()


def describe_point(point: Point | None) -> str:
    """A point as the user wrote it, for messages."""
    if point is None:
        return "the tip"
    return f"seq {point}" if isinstance(point, int) else format_time(point)


def before_or_at(item: Item, point: Point | None) -> bool:
    """Whether a stored message lies at or before `point` (None: the tip)."""
    record = item[0]
    if point is None:
        return True
    if isinstance(point, int):
        return record.seq <= point
    return record.timestamp <= point


async def window(
    log: EventLog,
    start: Point | None,
    end: Point | None,
    *,
    subjects: str = ALL_SUBJECTS,
) -> AsyncIterator[Item]:
    """The stored messages from `start` to `end` (both included; None: the first, the tip)."""
    from_seq = start if isinstance(start, int) else 1
    since = start if isinstance(start, datetime) else None
    async for item in records(log, from_seq, subjects=subjects, since=since):
        if not before_or_at(item, end):
            return
        yield item


async def fold_until(log: EventLog, point: Point | None) -> tuple[TreeState, int]:
    """The tree as it stood at `point`, and the sequence of the last message folded (0: none)."""
    state = TreeState()
    last = 0
    async for record, decoded in window(log, None, point):
        if isinstance(decoded, Recorded):
            state = evolve(state, decoded)
        last = record.seq
    return state, last


# -- grove tree --at -------------------------------------------------------------------------------


async def current_tree(conn: Connection, agent_id: str | None) -> TreeState:
    """The tree now, as the router keeps it; folded from the log here when it does not answer."""
    try:
        rows = await conn.client.routing.tree(agent_id)
    except RouterError as exc:
        if "no agent" in str(exc):
            raise UnknownAgent(agent_id or "") from None
        print(f"grove: the router did not answer ({exc}); folding the log", file=sys.stderr)
        return (await fold_until(conn.log, None))[0]
    return TreeState.from_rows({row["agent_id"]: row for row in rows})


async def show_tree_at(args: argparse.Namespace) -> int:
    """`grove tree [--at POINT]`: the agent tree now (the router's), or as it stood at a point
    of the log (folded from the log)."""
    async with connect(nats_url(args)) as conn:
        await tip(conn.log)
        if args.at is None:
            state, last = await current_tree(conn, args.agent), 0
        else:
            state, last = await fold_until(conn.log, args.at)
    if args.at is not None and last == 0:
        raise CliError(f"the log holds nothing at or before {describe_point(args.at)}")
    nodes = tops(state, args.agent)
    if args.json:
        out(json.dumps([tree_json(state, node) for node in nodes], indent=2))
    else:
        if args.at is not None:
            out(f"-- the tree at seq {last} --")
        out(render_tree(state, nodes))
    return 0


# -- grove replay ----------------------------------------------------------------------------------


async def replay(args: argparse.Namespace) -> int:
    """`grove replay`: print the log between two points, of one agent or of its subtree."""
    show = format_json if args.json else format_line
    start: Point | None = args.from_ if args.from_ is not None else args.from_seq
    if args.from_time is not None:
        start = args.from_time
    async with connect(nats_url(args)) as conn:
        await tip(conn.log)
        if args.agent is None:
            if args.subtree:
                raise CliError("--subtree needs --agent ID (the subtree's top agent)")
            async for item in window(conn.log, start, args.to):
                out(show(item))
            return 0
        await require_agent(conn.client, args.agent)
        if not args.subtree:
            subjects = f"grove.*.{args.agent}"
            async for item in window(conn.log, start, args.to, subjects=subjects):
                out(show(item))
            return 0
        async for item in subtree_items(conn.log, args.agent, start, args.to):
            out(show(item))
    return 0


async def subtree_items(
    log: EventLog, top: str, start: Point | None, end: Point | None
) -> AsyncIterator[Item]:
    """The messages of `top` and its descendants (as the tree knew them then) in a window."""
    state = TreeState()
    members = {top}
    shown_from = start
    async for item in window(log, None, end):
        record, decoded = item
        if not isinstance(decoded, Recorded):
            continue
        state = evolve(state, decoded)
        node = state.agents.get(decoded.event.agent_id)
        if node is not None and node.parent in members:
            members.add(node.agent_id)
        if decoded.event.agent_id not in members:
            continue
        if shown_from is None or (
            record.seq >= shown_from
            if isinstance(shown_from, int)
            else record.timestamp >= shown_from
        ):
            yield item


# -- grove diff ------------------------------------------------------------------------------------

#: The fields of an agent that `grove diff` compares.
DIFF_FIELDS = ("state", "last_status", "summary", "error", "children", "tokens", "parent")


@dataclass
class TreeDiff:
    """What changed in the tree between two points."""

    from_seq: int
    to_seq: int
    added: list[AgentNode]
    changed: dict[str, dict[str, tuple[Any, Any]]]

    def as_json(self) -> dict[str, Any]:
        """The difference as JSON-ready data."""
        return {
            "from_seq": self.from_seq,
            "to_seq": self.to_seq,
            "added": [asdict(node) for node in self.added],
            "changed": {
                agent: {name: {"from": old, "to": new} for name, (old, new) in fields.items()}
                for agent, fields in self.changed.items()
            },
        }

    def lines(self) -> Iterator[str]:
        """The difference as lines a person reads."""
        yield f"-- changes from seq {self.from_seq} to seq {self.to_seq} --"
        if not self.added and not self.changed:
            yield "(no change)"
        for node in self.added:
            parent = f" under {short_id(node.parent)}" if node.parent else " (a root)"
            yield f"+ {node.agent_id}{parent}  [{node.state}]  {node.task[:60]}"
        for agent, fields in self.changed.items():
            parts = []
            for name, (old, new) in fields.items():
                if name == "children":
                    parts.append("children +" + ",".join(short_id(c) for c in new[len(old) :]))
                else:
                    parts.append(f"{name}: {old!r} -> {new!r}")
            yield f"~ {agent}  " + "; ".join(parts)


def tree_diff(before: TreeState, after: TreeState, from_seq: int, to_seq: int) -> TreeDiff:
    """Compare two states of the tree (the second folded further than the first)."""
    added = [node for key, node in after.agents.items() if key not in before.agents]
    changed: dict[str, dict[str, tuple[Any, Any]]] = {}
    for key, old in before.agents.items():
        new = after.agents.get(key)
        if new is None:
            continue
        fields = {
            name: (getattr(old, name), getattr(new, name))
            for name in DIFF_FIELDS
            if getattr(old, name) != getattr(new, name)
        }
        if fields:
            changed[key] = fields
    return TreeDiff(from_seq, to_seq, added, changed)


def snapshot(state: TreeState) -> TreeState:
    """A copy of the tree that later folding does not change."""
    return TreeState.from_rows({key: asdict(node) for key, node in state.agents.items()})


async def diff_trees(log: EventLog, start: Point, end: Point | None) -> TreeDiff:
    """What changed in the tree from `start` to `end`, in one pass over the log."""
    state = TreeState()
    before: TreeState | None = None
    from_seq = last = 0
    async for record, decoded in window(log, None, end):
        if before is None and not before_or_at((record, decoded), start):
            before, from_seq = snapshot(state), last
        if isinstance(decoded, Recorded):
            state = evolve(state, decoded)
        last = record.seq
    if before is None:
        before, from_seq = snapshot(state), last
    return tree_diff(before, state, from_seq, last)


async def show_diff(args: argparse.Namespace) -> int:
    """`grove diff --from POINT [--to POINT]`: what changed in the tree between two points."""
    if isinstance(args.from_, int) and isinstance(args.to, int) and args.to < args.from_:
        raise CliError(f"--to ({args.to}) comes before --from ({args.from_})")
    async with connect(nats_url(args)) as conn:
        await tip(conn.log)
        difference = await diff_trees(conn.log, args.from_, args.to)
    if args.json:
        out(json.dumps(difference.as_json(), indent=2))
    else:
        for line in difference.lines():
            out(line)
    return 0


# -- grove export / grove import -------------------------------------------------------------------


def export_line(item: Item) -> str:
    """One stored message as a JSON line that `grove import` reads back."""
    record = item[0]
    line: dict[str, Any] = {
        "seq": record.seq,
        "subject": record.subject,
        "timestamp": record.timestamp.isoformat(),
        "headers": dict(record.headers or {}),
    }
    try:
        line["data"] = record.data.decode("utf-8")
    except UnicodeDecodeError:
        line["data_b64"] = base64.b64encode(record.data).decode("ascii")
    return json.dumps(line, ensure_ascii=False)


def progress(verb: str, count: int) -> None:
    """Tell a person on stderr how far a long export or import has come."""
    print(f"grove: {verb} {count} messages so far", file=sys.stderr, flush=True)


async def export_log(args: argparse.Namespace) -> int:
    """`grove export FILE.jsonl`: write the log (or a window of it) to a JSON-lines file."""
    target: Path = args.file
    count = 0
    first = last = 0
    async with connect(nats_url(args)) as conn:
        await tip(conn.log)
        with _open_for_writing(target) as stream:
            async for item in window(conn.log, args.from_, args.to):
                stream.write(export_line(item) + "\n")
                count += 1
                first = first or item[0].seq
                last = item[0].seq
                if count % PROGRESS_EVERY == 0:
                    progress("exported", count)
    span = f" (seq {first}..{last})" if count else ""
    out(f"exported {count} messages{span} to {target}")
    return 0


def _open_for_writing(target: Path) -> IO[str]:
    try:
        return target.open("w", encoding="utf-8")
    except OSError as exc:
        raise CliError(f"cannot write {target}: {exc.strerror}") from None


@dataclass(frozen=True)
class ExportedMessage:
    """One line of an export file, ready to publish again."""

    subject: str
    data: bytes
    headers: dict[str, str]


def read_export_line(text: str, number: int, source: Path) -> ExportedMessage:
    """Parse one line of an export file; errors name the file and the line."""
    where = f"{source}:{number}"
    try:
        line = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CliError(
            f"{where}: not a JSON line ({exc.msg}); was it written by `grove export`?"
        ) from None
    if not isinstance(line, dict) or not isinstance(line.get("subject"), str):
        raise CliError(f"{where}: a line needs at least 'subject' and 'data'")
    subject: str = line["subject"]
    if not subject.startswith("grove.") or subject.startswith("grove.rpc."):
        raise CliError(f"{where}: {subject!r} is not a subject of the {STREAM_NAME} stream")
    if isinstance(line.get("data"), str):
        data = line["data"].encode("utf-8")
    elif isinstance(line.get("data_b64"), str):
        data = base64.b64decode(line["data_b64"])
    else:
        raise CliError(f"{where}: a line needs 'data' (text) or 'data_b64'")
    headers = {
        str(k): str(v)
        for k, v in (line.get("headers") or {}).items()
        if not str(k).startswith(GUARD_HEADER_PREFIX)
    }
    data = _with_original_time(data, line.get("timestamp"))
    return ExportedMessage(subject, data, headers)


def _with_original_time(data: bytes, timestamp: Any) -> bytes:
    """An event without a `timestamp` took the stream's; a copy keeps that original time."""
    if not isinstance(timestamp, str):
        return data
    try:
        body = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return data
    if not isinstance(body, dict) or body.get("timestamp") is not None:
        return data
    body["timestamp"] = timestamp
    return json.dumps(body).encode()


def read_export(source: Path) -> list[ExportedMessage]:
    """Every message of an export file, checked before anything is published."""
    try:
        lines = source.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise CliError(f"cannot read {source}: {exc.strerror}") from None
    return [
        read_export_line(text, number, source)
        for number, text in enumerate(lines, start=1)
        if text.strip()
    ]


async def publish_export(log: EventLog, messages: list[ExportedMessage]) -> tuple[int, int]:
    """Append the messages in order, pipelined; returns (stored, duplicates)."""
    stored = duplicates = 0
    for start in range(0, len(messages), IMPORT_WINDOW):
        futures = [
            await log.js.publish_async(m.subject, m.data, headers=m.headers or None)
            for m in messages[start : start + IMPORT_WINDOW]
        ]
        for future in futures:
            ack = await future
            if ack.duplicate:
                duplicates += 1
            else:
                stored += 1
        if (start + IMPORT_WINDOW) % PROGRESS_EVERY == 0:
            progress("imported", stored + duplicates)
    return stored, duplicates


async def import_into(url: str, messages: list[ExportedMessage], append: bool) -> str:
    """Import into the stream at `url`; refuses a stream that holds events unless `append`."""
    async with connect(url) as conn:
        await conn.log.ensure_stream()
        present = await conn.log.last_seq()
        if present and not append:
            raise CliError(
                f"the {STREAM_NAME} stream at {url} already holds {present} messages; import "
                "into a fresh stack (grove import FILE --data-dir NEW_DIR), or pass --append"
            )
        stored, duplicates = await conn.guard(publish_export(conn.log, messages))
        last = await conn.log.last_seq()
    note = f", {duplicates} already there" if duplicates else ""
    return f"imported {stored} messages{note} into {url} (the log now ends at seq {last})"


async def import_log(args: argparse.Namespace) -> int:
    """`grove import FILE.jsonl`: load an exported log into a stopped or fresh stack.

    Services must not run while the copy is written (they would act on its events one by one);
    with no NATS reachable, the command starts the data folder's own nats-server for the
    import and stops it after, so that `grove up --data-dir DIR` replays the copy next.
    """
    messages = read_export(args.file)
    folder = data_dir(args)
    explicit = args.nats_url is not None
    url = nats_url(args)
    if explicit or await reachable(url):
        if not explicit and (folder / "stack.json").exists():
            raise CliError(
                f"a stack is running in {folder}; its services would act on the events while "
                "they are imported: stop it (Ctrl-C on `grove up`) and import again"
            )
        out(await import_into(url, messages, args.append))
        return 0
    server = LocalNatsServer(folder / "nats").start()
    try:
        out(await import_into(server.url, messages, args.append))
    finally:
        server.stop()
    out(f"start the stack on it with: grove up --data-dir {folder}")
    return 0


# -- the commands ----------------------------------------------------------------------------------


def add_commands(commands: Subcommands, common: Parser) -> None:
    """Register `tree`, `replay`, `diff`, `export` and `import`."""
    point_help = "a sequence number or an ISO 8601 time"
    tree = commands.add_parser(
        "tree", parents=[common], help="print the agent tree (now, or at a point of the log)"
    )
    tree.add_argument("--json", action="store_true", help="nested JSON")
    tree.add_argument(
        "--agent", metavar="ID", type=agent_id, help="only this agent and its descendants"
    )
    tree.add_argument(
        "--at", metavar="SEQ|TIME", type=log_point, help=f"the tree as it stood then ({point_help})"
    )
    tree.set_defaults(handler=run_async(show_tree_at))

    replay_cmd = commands.add_parser("replay", parents=[common], help="print the log")
    replay_cmd.add_argument(
        "--from", dest="from_", metavar="SEQ|TIME", type=log_point, help=f"first ({point_help})"
    )
    replay_cmd.add_argument(
        "--to", metavar="SEQ|TIME", type=log_point, help=f"last ({point_help}; default: the tip)"
    )
    replay_cmd.add_argument(
        "--from-seq", metavar="N", type=log_point, default=None, help="same as --from N"
    )
    replay_cmd.add_argument(
        "--from-time", metavar="ISO", type=log_point, default=None, help="same as --from TIME"
    )
    replay_cmd.add_argument("--agent", metavar="ID", type=agent_id, help="only this agent's events")
    replay_cmd.add_argument(
        "--subtree", action="store_true", help="with --agent: its descendants' events too"
    )
    replay_cmd.add_argument("--json", action="store_true", help="JSON lines")
    replay_cmd.set_defaults(handler=run_async(replay))

    diff = commands.add_parser(
        "diff", parents=[common], help="what changed in the agent tree between two points"
    )
    diff.add_argument(
        "--from", dest="from_", metavar="SEQ|TIME", type=log_point, required=True, help=point_help
    )
    diff.add_argument("--to", metavar="SEQ|TIME", type=log_point, help="default: the tip")
    diff.add_argument("--json", action="store_true", help="JSON")
    diff.set_defaults(handler=run_async(show_diff))

    export = commands.add_parser(
        "export", parents=[common], help="write the log to a JSON-lines file"
    )
    export.add_argument("file", type=Path, metavar="FILE.jsonl")
    export.add_argument("--from", dest="from_", metavar="SEQ|TIME", type=log_point)
    export.add_argument("--to", metavar="SEQ|TIME", type=log_point)
    export.set_defaults(handler=run_async(export_log))

    imp = commands.add_parser(
        "import",
        parents=[common],
        help="load an exported log into a fresh stack (its services stopped)",
    )
    imp.add_argument("file", type=Path, metavar="FILE.jsonl")
    imp.add_argument(
        "--append", action="store_true", help="add to a stream that already holds events"
    )
    imp.set_defaults(handler=run_async(import_log))

"""Catching up in a helper process: a long replay read on another CPU.

A replay costs its reader about 8 µs of CPU per message in nats-py (parsing the protocol and the
headers, making the message objects, the subscription's queue): as much as a projection spends
decoding and folding the event. When a projection is far behind, a helper process
(`python -m grove_core.catchup`) reads that part of the log over its own connection and hands
the records over a pipe in batches, where the projection takes each one for under a
microsecond; reading and folding then run at the same time, on two CPUs.

The pipe carries frames: a 4-byte big-endian length, then a `marshal`led list of records as
tuples (sequence, subject, data, stream time in milliseconds, headers, pending; the headers as
their unparsed lines when they came unparsed, see `LazyHeaders`). A frame of
length zero ends the catch-up: every record up to the sequence asked for was sent. The helper
reads its instructions as one line of JSON on its standard input and exits when that input
closes, so it never outlives the process that started it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import marshal
import os
import stat
import sys
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import uvloop

from grove_core.connection import LazyHeaders
from grove_core.log import EventLog
from grove_core.records import RawRecord
from grove_core.settings import CATCH_UP_HELPER_MIN, NatsAccess
from grove_events import StreamDefinition

log = logging.getLogger(__name__)

#: Records in one frame of the pipe.
FRAME_RECORDS = 500
#: Bytes of a frame's length prefix.
_PREFIX = 4
#: The largest frame a reader accepts: a frame of records at the stream's largest message
#: size (1 MiB, nats-server's default), with room for subjects and headers.
MAX_FRAME = FRAME_RECORDS * (2 << 20)
#: Bytes the reader takes from the pipe ahead of the records it has handed on (it stops
#: reading at twice this). The helper then blocks on the full pipe, stops taking messages,
#: and the server's flow control holds the rest: a slow fold never holds the log in memory.
READ_AHEAD = 1 << 20
#: Seconds a helper whose reader is gone gives its connection to close before it exits anyway.
STOP_WITHIN = 2.0


@dataclass(frozen=True)
class CatchUpHelper:
    """That a log's projections read a catch-up of at least `min_events` events through a
    helper process, and how the helper connects."""

    access: NatsAccess
    min_events: int = CATCH_UP_HELPER_MIN


class CatchUpError(RuntimeError):
    """The helper process stopped before it sent everything asked for."""


def _frame(records: list[tuple[Any, ...]]) -> bytes:
    body = marshal.dumps(records)
    return len(body).to_bytes(_PREFIX, "big") + body


def _sent_headers(headers: Mapping[str, str] | None) -> bytes | dict[str, str] | None:
    """Headers in a form `marshal` takes: unparsed lines stay unparsed."""
    if headers is None or isinstance(headers, dict):
        return headers
    if isinstance(headers, LazyHeaders):
        return headers.lines
    return dict(headers)


def _records(body: bytes) -> list[RawRecord]:
    # The same stream time as a delivery's (`delivery_position`): milliseconds over 1000.
    return [
        RawRecord(
            seq,
            subject,
            data,
            datetime.fromtimestamp(ms / 1000, UTC),
            LazyHeaders(headers) if isinstance(headers, bytes) else headers,
            pending,
        )
        # The frames come from this module's own helper, through a pipe nothing else writes.
        for seq, subject, data, ms, headers, pending in marshal.loads(body)  # noqa: S302
    ]


async def read_in_helper(
    access: NatsAccess,
    stream: str,
    from_seq: int,
    until_seq: int,
    *,
    name: str = "catch-up",
) -> AsyncGenerator[RawRecord, None]:
    """The records of `stream` from `from_seq` to `until_seq`, read by a helper process that
    connects with `access`.

    Raises CatchUpError when the helper stops early; every record yielded before that is good
    (in order, none missing), so the caller can go on reading after the last one itself.
    """
    instructions = {
        "access": access.as_dict(),
        "stream": stream,
        "from_seq": from_seq,
        "until_seq": until_seq,
        "name": name,
    }
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "grove_core.catchup",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            limit=READ_AHEAD,
        )
    except OSError as exc:
        raise CatchUpError(f"cannot start the catch-up helper: {exc}") from None
    assert proc.stdin is not None
    assert proc.stdout is not None
    finished = False
    try:
        try:
            proc.stdin.write(json.dumps(instructions).encode() + b"\n")
            await proc.stdin.drain()
        except ConnectionError:  # it is gone already
            code = await proc.wait()
            raise CatchUpError(f"the catch-up helper stopped at once (exit code {code})") from None
        while True:
            try:
                size = int.from_bytes(await proc.stdout.readexactly(_PREFIX), "big")
                if size == 0:
                    finished = True
                    return
                if size > MAX_FRAME:
                    raise CatchUpError(f"the catch-up helper sent a frame of {size} bytes")
                body = await proc.stdout.readexactly(size)
            except (asyncio.IncompleteReadError, ConnectionError):
                code = await proc.wait()
                raise CatchUpError(
                    f"the catch-up helper stopped early (exit code {code})"
                ) from None
            for record in _records(body):
                yield record
    finally:
        proc.stdin.close()  # a helper exits when its input closes
        if not finished and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        try:
            # Not `wait_for`: on Python 3.11 it can swallow a cancellation that comes as the
            # process ends, and the cancelled reader would go on reading.
            async with asyncio.timeout(5.0):
                await proc.wait()
        except TimeoutError:  # done with, and not gone: no helper outlives its reader
            with contextlib.suppress(ProcessLookupError):
                proc.kill()


# -- the helper process ---------------------------------------------------------------------


async def _send(instructions: dict[str, Any], sent: asyncio.Event) -> None:
    """Read the range asked for and write it to standard output, frame by frame; `sent` is
    set once the last frame is out."""
    access = NatsAccess(**instructions["access"])
    event_log = await EventLog.connect(
        access.url,
        name=instructions["name"],
        definition=StreamDefinition(name=instructions["stream"]),
        reachable_within=10.0,
        **access.options(),
    )
    out = sys.stdout.buffer
    records = event_log.read(instructions["from_seq"], until_seq=instructions["until_seq"])
    try:
        batch: list[tuple[Any, ...]] = []
        async with contextlib.aclosing(records):  # its subscription ends with the sending
            async for raw in records:
                milliseconds = round(raw.timestamp.timestamp() * 1000)
                batch.append(
                    (
                        raw.seq,
                        raw.subject,
                        raw.data,
                        milliseconds,
                        _sent_headers(raw.headers),
                        raw.pending,
                    )
                )
                if len(batch) >= FRAME_RECORDS:
                    out.write(_frame(batch))  # blocks while the pipe is full: the reader's pace
                    batch = []
        if batch:
            out.write(_frame(batch))
        out.write((0).to_bytes(_PREFIX, "big"))
        out.flush()
        sent.set()
    finally:
        await event_log.close(drain=False)  # it published nothing


async def _main() -> int:
    loop = asyncio.get_running_loop()
    instructions = asyncio.StreamReader()
    await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(instructions), sys.stdin.buffer
    )
    line = await instructions.readline()
    if not line.strip():
        return 2
    sent = asyncio.Event()
    sender = asyncio.create_task(_send(json.loads(line), sent))
    orphaned = asyncio.create_task(instructions.read())  # until the input closes
    await asyncio.wait({sender, orphaned}, return_when=asyncio.FIRST_COMPLETED)
    if not sender.done():
        # The reader closed its end: done with what was sent, or gone before the end.
        code = 0 if sent.is_set() else 1
        sender.cancel()
        _, pending = await asyncio.wait({sender}, timeout=STOP_WITHIN)
        if pending:  # never outlive the reader, whatever the connection waits for
            log.error("the reader is gone and the connection did not close; exiting")
            logging.shutdown()
            os._exit(code)
        with contextlib.suppress(asyncio.CancelledError, OSError):
            sender.result()  # a broken pipe is the reader's going, told by the code
        return code
    sender.result()
    return 0


def main() -> None:
    """Entry point of the helper process."""
    logging.basicConfig(level=logging.WARNING, format="catch-up helper: %(message)s")
    mode = os.fstat(sys.stdin.fileno()).st_mode
    if not (stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)):
        log.error("reads its instructions from a pipe, from the process that reads the records")
        sys.exit(2)
    try:
        code = uvloop.run(_main())
    except BrokenPipeError:
        code = 1
    except Exception:  # the reader is told by the exit code
        log.exception("reading the log failed")
        code = 1
    sys.exit(code)


if __name__ == "__main__":
    main()

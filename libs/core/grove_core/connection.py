"""The NATS connection of the event log: nats-py's client, with a faster parse of headers and
subscriptions whose messages are handed over in the read loop.

Every event on the log carries `Nats-Msg-Id`, and a guarded append one or two more headers (the
expected sequence, and on the governor's decisions the subject it applies to), which the stream
stores with the message and hands to every reader. nats-py parses each header line by decoding
its name and testing it for whitespace one character at a time in a generator: about 4 µs for an
admission's three headers. Each event is read by four services, and four in five of an agent's
events are guarded.

`GroveConnection` parses them to the same result (`parse_header_lines`, held equal to nats-py's
by a property test): header names repeat, so each name is checked once and remembered (up to
`KNOWN_NAMES_MAX` of them), and the whitespace test is one `str.split`. About 1.1 µs for the same
three headers.

nats-py hands each message of a subscription with a callback to a task of its own, through a
queue, as a `Msg` object, to a coroutine. The log's busiest subscriptions (every replay's and
projection's deliveries, and the stream's acknowledgements of appends) only append what arrives
to a queue of their own or complete a future. `subscribe_direct` gives each message to a plain
function straight from the read loop instead, in the order they came: no `Msg`, no queue, no
task switch. The function must be quick and must not block; what it raises is reported to the
connection's error callback, as nats-py does for callbacks. The headers of a message with a
body come as `LazyHeaders`, parsed only when read: the services fold events from their bodies
and never look at those headers (a replay shown by `grove debug` does).

Both override private methods of nats-py's client (`_parse_header_lines`, `_process_msg`,
`_remove_sub`), so `pyproject.toml` admits only the nats-py minor version they were written
and tested against; `tests/integration/test_direct.py` fails when the hooks stop being called.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

#: Takes one message of a direct subscription: its subject, reply subject, body and headers.
DirectHandler = Callable[[str, str, bytes, Mapping[str, str] | None], None]

#: How a header block without a status begins (with one: `NATS/1.0 100 Idle Heartbeat`).
_NO_STATUS = b"NATS/1.0\r\n"

#: Header names remembered once checked; names past this many are checked at every message.
KNOWN_NAMES_MAX = 256

#: A raw header name -> its name as text, or None where nats-py drops the line.
_known_names: dict[bytes, str | None] = {}


def _header_name(raw: bytes) -> str | None:
    """A header line's name as nats-py reads it: ASCII, no whitespace inside once stripped
    (None: the line is dropped)."""
    try:
        name = raw.strip().decode("ascii")
    except UnicodeDecodeError:
        return None
    # `split` cuts at exactly the characters `str.isspace` accepts: a name with none of them
    # splits into itself alone (and the empty name into nothing, which nats-py keeps).
    if name and name.split() != [name]:
        return None
    return name


def parse_header_lines(raw: bytes) -> dict[str, str]:
    """`Name: Value` lines (CRLF-separated) to a dict, as nats-py's `_parse_header_lines`."""
    headers: dict[str, str] = {}
    for line in raw.split(b"\r\n"):
        raw_name, colon, value = line.partition(b":")
        if not colon:
            continue
        try:
            name = _known_names[raw_name]
        except KeyError:
            name = _header_name(raw_name)
            if len(_known_names) < KNOWN_NAMES_MAX:
                _known_names[raw_name] = name
        if name is not None:
            headers[name] = value.strip().decode("utf-8", "replace")
    return headers


class LazyHeaders(Mapping[str, str]):
    """A message's headers (a block with no status line), parsed on first use as
    `parse_header_lines` parses them."""

    __slots__ = ("_parsed", "lines")

    def __init__(self, lines: bytes) -> None:
        #: The `Name: Value` lines after the block's first line, as received.
        self.lines = lines
        self._parsed: dict[str, str] | None = None

    def _headers(self) -> dict[str, str]:
        if self._parsed is None:
            self._parsed = parse_header_lines(self.lines)
        return self._parsed

    def __getitem__(self, name: str) -> str:
        return self._headers()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._headers())

    def __len__(self) -> int:
        return len(self._headers())

    def __repr__(self) -> str:
        return f"LazyHeaders({self._headers()!r})"


class GroveConnection(Client):
    """nats-py's client, reading message headers with `parse_header_lines`, with direct
    subscriptions (`subscribe_direct`)."""

    _parse_header_lines = staticmethod(parse_header_lines)

    def __init__(self) -> None:
        super().__init__()
        #: subscription id -> the function its messages go to
        self._direct: dict[int, DirectHandler] = {}

    async def _process_msg(
        self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes
    ) -> None:
        handle = self._direct.get(sid)
        if handle is None:
            await super()._process_msg(sid, subject, reply, data, headers)
            return
        self.stats["in_msgs"] += 1
        self.stats["in_bytes"] += len(data)
        parsed: Mapping[str, str] | None = None
        if headers:
            if data and headers.startswith(_NO_STATUS):
                parsed = LazyHeaders(headers[len(_NO_STATUS) :])
            else:  # a status (these have no body), or another form: parsed now, by nats-py
                parsed = await self._process_headers(headers)
        try:
            handle(subject.decode(), reply.decode(), data, parsed)
        except Exception as exc:  # noqa: BLE001 - as for a callback: reported, and the loop goes on
            await self._error_cb(exc)

    def _remove_sub(self, sid: int, max_msgs: int = 0) -> None:
        self._direct.pop(sid, None)
        super()._remove_sub(sid, max_msgs)


async def subscribe_direct(nc: Client, subject: str, handle: DirectHandler) -> Subscription:
    """Subscribe `handle` to `subject`; on a `GroveConnection`, it is called in the read loop.

    Nothing may be sent to `subject` before this returns (the subject is a fresh inbox whose
    senders are told of it afterwards): a message arriving before the function is registered
    would wait in the subscription's queue. On any other client the function is called from an
    ordinary callback.
    """
    if isinstance(nc, GroveConnection):
        sub = await nc.subscribe(subject)
        nc._direct[sub._id] = handle
        return sub

    async def callback(msg: Msg) -> None:
        handle(msg.subject, msg.reply, msg.data, msg.headers)

    return await nc.subscribe(subject, cb=callback)

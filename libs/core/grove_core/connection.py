"""The NATS connection of the event log: nats-py's client, reading and writing messages faster,
with subscriptions whose messages are handed over in the read loop.

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

Below both, `GroveParser` reads the protocol itself: the same calls as nats-py's parser (held
equal by a property test over streams cut at arbitrary places) for less work per message, and a
direct subscription's message goes to its function without a coroutine.

Appends leave by `GroveConnection.publish_headed`: their header block encoded once
(`header_block`), the command built in one step and queued as nats-py queues it.

These override or use private parts of nats-py's client (`_ps`, `_parse_header_lines`,
`_process_msg`, `_remove_sub`, and its outgoing queue: `_send_command`, `_flush_pending`), so
`pyproject.toml` admits only the nats-py minor version they were written and tested against;
`tests/integration/test_direct.py` fails when the hooks stop being called, and
`tests/unit/test_protocol_parse.py` when the bytes read or sent differ from nats-py's.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping

from nats import errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.protocol import parser as protocol

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


def header_block(headers: Mapping[str, str]) -> bytes:
    """A message's headers as sent: `NATS/1.0`, a `Name: Value` line for each, a blank line
    (raises ValueError for a name or value that would break a line)."""
    lines = [_NO_STATUS]
    for name, value in headers.items():
        line = f"{name}: {value}\r\n"
        if line.count("\r") != 1 or line.count("\n") != 1 or ":" in name or not name.strip():
            raise ValueError(f"header {name!r}: {value!r} cannot be sent")
        lines.append(line.encode())
    lines.append(b"\r\n")
    return b"".join(lines)


class GroveParser(protocol.Parser):
    """nats-py's protocol parser, made faster for a stream of messages.

    nats-py's parser tries a regular expression for `MSG`, then one for `HMSG`, on each control
    line, keeps what it matched in a dict, cuts each line and each body off the front of its
    buffer, and awaits the client's `_process_msg` for every message. This one finds the end of
    the line, splits it, reads every whole message in the buffer by position and cuts the buffer
    once. A message only partly received is read again from its control line when more comes
    (its line is short; nothing is kept between calls). A message of a direct subscription that
    has a body and no status is handed to its function here, without a coroutine.

    Other lines (`+OK`, `PING`, `PONG`, `-ERR`, `INFO`) are matched by nats-py's own patterns
    and handed to the client as nats-py does. `tests/unit/test_protocol_parse.py` holds the two
    parsers to the same calls on arbitrary streams cut at arbitrary places.
    """

    nc: GroveConnection

    async def parse(self, data: bytes = b"") -> None:
        buf = self.buf
        buf.extend(data)
        nc = self.nc
        direct = nc._direct
        pos = 0
        end = len(buf)
        try:
            # A handler may reset the parser (an error that closes the connection): what is
            # left of the old buffer is then not read.
            while pos < end and self.buf is buf:
                eol = buf.find(b"\r\n", pos)
                if eol < 0:  # the line is not all here yet
                    break
                if buf.startswith(b"HMSG", pos) or buf.startswith(b"MSG", pos):
                    sid, subject, reply, header_size, size = _message_line(buf[pos:eol])
                    start = eol + 2
                    stop = start + size
                    if stop + 2 > end:  # the body is not all here yet
                        break
                    pos = stop + 2
                    if header_size:
                        headers: bytes | None = bytes(buf[start : start + header_size])
                        body = bytes(buf[start + header_size : stop])
                    else:
                        headers = None
                        body = bytes(buf[start:stop])
                    handle = direct.get(sid)
                    if handle is not None and _goes_unparsed(body, headers):
                        failed = nc._hand_over(handle, subject, reply, body, headers)
                        if failed is not None:
                            await nc._error_cb(failed)
                    else:
                        await nc._process_msg(sid, subject, reply, body, headers)
                    continue
                line = bytes(buf[pos : eol + 2])
                pos = eol + 2
                await self._control(line)
        finally:
            del buf[:pos]

    async def _control(self, line: bytes) -> None:
        """A whole control line other than a message's, handled as nats-py handles it."""
        nc = self.nc
        if protocol.OK_RE.match(line):
            return
        if protocol.PING_RE.match(line):
            await nc._process_ping()
            return
        if protocol.PONG_RE.match(line):
            await nc._process_pong()
            return
        matched = protocol.ERR_RE.match(line)
        if matched:
            await nc._process_err((matched.group(1) or b"").decode().lower())
            return
        matched = protocol.INFO_RE.match(line)
        if matched:
            await nc._process_info(json.loads(matched.group(1).decode()))
            return
        raise errors.ProtocolError("nats: unknown protocol")


def _goes_unparsed(data: bytes, headers: bytes | None) -> bool:
    """Whether a direct subscription's message is handed over with its headers as received:
    it has none, or a block without a status and a body (a status is parsed at once)."""
    return not headers or (bool(data) and headers.startswith(_NO_STATUS))


def _message_line(line: bytearray) -> tuple[int, bytes, bytes, int, int]:
    """(sid, subject, reply, header size, total size) of `MSG <subject> <sid> [reply] <size>`
    or `HMSG <subject> <sid> [reply] <header size> <total size>` (raises ProtocolError)."""
    args = line.split()
    try:
        if args[0] == b"HMSG":
            if len(args) == 6:
                return int(args[2]), bytes(args[1]), bytes(args[3]), int(args[4]), int(args[5])
            if len(args) == 5:
                return int(args[2]), bytes(args[1]), b"", int(args[3]), int(args[4])
        elif args[0] == b"MSG":
            if len(args) == 5:
                return int(args[2]), bytes(args[1]), bytes(args[3]), 0, int(args[4])
            if len(args) == 4:
                return int(args[2]), bytes(args[1]), b"", 0, int(args[3])
    except ValueError:
        pass
    raise errors.ProtocolError("nats: malformed MSG")


class GroveConnection(Client):
    """nats-py's client, reading the protocol with `GroveParser` and message headers with
    `parse_header_lines`, with direct subscriptions (`subscribe_direct`)."""

    _parse_header_lines = staticmethod(parse_header_lines)

    def __init__(self) -> None:
        super().__init__()
        #: subscription id -> the function its messages go to
        self._direct: dict[int, DirectHandler] = {}
        self._ps = GroveParser(self)

    async def _process_msg(
        self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes | None
    ) -> None:
        handle = self._direct.get(sid)
        if handle is None:
            await super()._process_msg(sid, subject, reply, data, headers)  # type: ignore[arg-type]
            return
        if _goes_unparsed(data, headers):
            failed = self._hand_over(handle, subject, reply, data, headers or None)
        else:  # a status (these have no body), or another form: parsed now, by nats-py
            parsed = await self._process_headers(headers)
            failed = self._hand_over(handle, subject, reply, data, parsed)
        if failed is not None:
            await self._error_cb(failed)

    def _hand_over(
        self,
        handle: DirectHandler,
        subject: bytes,
        reply: bytes,
        data: bytes,
        headers: bytes | Mapping[str, str] | None,
    ) -> Exception | None:
        """Give a direct subscription's message to its function; `headers` as received (a
        block that begins without a status) or parsed already. Returns what the function
        raised, for the connection's error callback (as for a callback: the loop goes on)."""
        self.stats["in_msgs"] += 1
        self.stats["in_bytes"] += len(data)
        if isinstance(headers, bytes):
            parsed: Mapping[str, str] | None = LazyHeaders(headers[len(_NO_STATUS) :])
        else:
            parsed = headers
        try:
            handle(subject.decode(), reply.decode(), data, parsed)
        except Exception as exc:  # noqa: BLE001 - reported by the caller
            return exc
        return None

    async def publish_headed(
        self, subject: str, reply: str, headers: bytes, payload: bytes
    ) -> None:
        """Publish with a header block encoded already (`header_block`).

        The same checks of the connection and the payload's size as nats-py's `publish`, and
        the same message on the wire. nats-py's check of the subject, the reply and each
        header name by regular expression is left out: the log's subjects and inboxes are
        made from validated tokens. About 1 µs of CPU per message, against 5.4 µs for
        `publish` with two headers.
        """
        if self.is_closed:
            raise errors.ConnectionClosedError
        if self.is_draining_pubs:
            raise errors.ConnectionDrainingError
        size = len(payload)
        if not self.is_connected and (
            self._max_pending_size <= 0 or size + self._pending_data_size > self._max_pending_size
        ):
            raise errors.OutboundBufferLimitError
        if size > self._max_payload:
            raise errors.MaxPayloadError
        command = b"HPUB %b %b %d %d\r\n%b%b\r\n" % (
            subject.encode(),
            reply.encode(),
            len(headers),
            len(headers) + size,
            headers,
            payload,
        )
        self.stats["out_msgs"] += 1
        self.stats["out_bytes"] += size
        await self._send_command(command)
        if self._flush_queue is not None and self._flush_queue.empty():
            await self._flush_pending()

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

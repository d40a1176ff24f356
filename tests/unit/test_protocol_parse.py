"""The event log's connection reads and writes the NATS protocol as nats-py does, only faster."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from nats.errors import ConnectionClosedError, MaxPayloadError, ProtocolError
from nats.protocol.parser import Parser

from grove_core.connection import GroveConnection, GroveParser, LazyHeaders, header_block

pytestmark = pytest.mark.unit


class Recorder:
    """What a parser asks of its client, in order (a client with no direct subscriptions)."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self._direct: dict[int, Any] = {}

    async def _process_msg(
        self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes | None
    ) -> None:
        self.calls.append(("msg", sid, bytes(subject), bytes(reply), data, headers))

    async def _process_ping(self) -> None:
        self.calls.append(("ping",))

    async def _process_pong(self) -> None:
        self.calls.append(("pong",))

    async def _process_err(self, message: str) -> None:
        self.calls.append(("err", message))

    async def _process_info(self, info: dict[str, Any]) -> None:
        self.calls.append(("info", info))


tokens = st.text("abcXYZ019_-.$>*", min_size=1, max_size=12)
bodies = st.binary(max_size=40) | st.sampled_from([b"", b"\r\n", b"MSG a 1 2\r\n", b"PING\r\n"])
header_blocks = st.sampled_from(
    [
        b"NATS/1.0\r\nNats-Msg-Id: 1\r\n\r\n",
        b"NATS/1.0 100 Idle Heartbeat\r\nNats-Last-Consumer: 3\r\n\r\n",
        b"NATS/1.0 408 Request Timeout\r\n\r\n",
        b"NATS/1.0\r\n\r\n",
    ]
)


def _hmsg(head: bytes, headers: bytes, body: bytes) -> bytes:
    """`HMSG <head> <header size> <total size>`, then the headers and the body."""
    size = len(headers) + len(body)
    return b"HMSG %b %d %d\r\n%b%b\r\n" % (head, len(headers), size, headers, body)


@st.composite
def messages(draw: st.DrawFn) -> bytes:
    subject = draw(tokens).encode()
    sid = str(draw(st.integers(1, 10_000))).encode()
    reply = draw(st.none() | tokens)
    body = draw(bodies)
    head = b" ".join([subject, sid] + ([reply.encode()] if reply else []))
    if draw(st.booleans()):
        return _hmsg(head, draw(header_blocks), body)
    return b"MSG %b %d\r\n%b\r\n" % (head, len(body), body)


others = st.sampled_from(
    [
        b"+OK\r\n",
        b"PING\r\n",
        b"PONG\r\n",
        b"-ERR 'Stale Connection'\r\n",
        b'INFO {"server_id":"x","max_payload":1048576}\r\n',
    ]
)
streams = st.lists(messages() | others, max_size=12).map(b"".join)


async def _feed(parser: Parser, stream: bytes, cuts: list[int]) -> None:
    last = 0
    for cut in sorted(cuts):
        await parser.parse(stream[last:cut])
        last = cut
    await parser.parse(stream[last:])


def _parsed(cls: type[Parser], stream: bytes, cuts: list[int]) -> list[tuple[Any, ...]]:
    recorder = Recorder()
    parser = cls(recorder)
    asyncio.run(_feed(parser, stream, cuts))
    assert not parser.buf  # nothing left over once the whole stream has come
    return recorder.calls


@given(streams, st.lists(st.integers(0, 2_000), max_size=8))
def test_the_same_calls_as_nats_py_however_the_stream_is_cut(
    stream: bytes, cuts: list[int]
) -> None:
    cuts = [cut for cut in cuts if cut <= len(stream)]
    assert _parsed(GroveParser, stream, cuts) == _parsed(Parser, stream, cuts)


class ResettingRecorder(Recorder):
    """A client whose error handling resets its parser, as a closing connection does."""

    parser: Parser

    async def _process_err(self, message: str) -> None:
        await super()._process_err(message)
        self.parser.reset()


@pytest.mark.parametrize("cls", [Parser, GroveParser])
def test_nothing_is_read_after_a_handler_resets_the_parser(cls: type[Parser]) -> None:
    recorder = ResettingRecorder()
    recorder.parser = cls(recorder)
    asyncio.run(recorder.parser.parse(b"MSG a 1 1\r\nx\r\n-ERR 'Stale Connection'\r\nPING\r\n"))
    assert recorder.calls == [("msg", 1, b"a", b"", b"x", None), ("err", "'stale connection'")]
    assert not recorder.parser.buf


def test_a_message_in_pieces_comes_once_whole() -> None:
    stream = _hmsg(b"a.b 9 r", b"NATS/1.0\r\n\r\n", b"abc") + b"PING\r\n"
    calls = _parsed(GroveParser, stream, list(range(len(stream))))
    assert calls == [("msg", 9, b"a.b", b"r", b"abc", b"NATS/1.0\r\n\r\n"), ("ping",)]


@pytest.mark.parametrize(
    "line",
    [b"MSG a\r\n", b"MSG a b 3\r\nabc\r\n", b"HMSG a 1 x y\r\n", b"HELLO\r\n"],
)
def test_malformed_lines_are_protocol_errors(line: bytes) -> None:
    with pytest.raises(ProtocolError):
        asyncio.run(GroveParser(Recorder()).parse(line))


def test_direct_subscriptions_get_bodies_with_lazy_headers_and_statuses_parsed() -> None:
    async def run() -> list[tuple[str, str, bytes, Mapping[str, str] | None]]:
        nc = GroveConnection()
        got: list[tuple[str, str, bytes, Mapping[str, str] | None]] = []
        nc._direct[5] = lambda subject, reply, data, headers: got.append(
            (subject, reply, data, headers)
        )
        await nc._ps.parse(
            _hmsg(b"s 5 r", b"NATS/1.0\r\nNats-Msg-Id: 1\r\n\r\n", b"hi")
            + _hmsg(b"s 5", b"NATS/1.0 100 Idle Heartbeat\r\nA: 1\r\n\r\n", b"")
            + b"MSG s 5 2\r\nno\r\n"
        )
        return got

    (first, status, plain) = asyncio.run(run())
    assert first[:3] == ("s", "r", b"hi")
    assert isinstance(first[3], LazyHeaders)
    assert dict(first[3]) == {"Nats-Msg-Id": "1"}
    assert status[2] == b""
    assert status[3] is not None
    assert dict(status[3]) == {"Status": "100", "Description": "Idle Heartbeat", "A": "1"}
    assert plain == ("s", "", b"no", None)


def test_a_direct_function_that_raises_is_reported_and_the_next_message_still_comes() -> None:
    async def run() -> tuple[list[bytes], list[BaseException]]:
        nc = GroveConnection()
        errors: list[BaseException] = []

        async def error_cb(exc: BaseException) -> None:
            errors.append(exc)

        nc._error_cb = error_cb
        got: list[bytes] = []

        def handle(subject: str, reply: str, data: bytes, headers: object) -> None:
            if data == b"bad":
                raise ValueError("refused")
            got.append(data)

        nc._direct[1] = handle
        await nc._ps.parse(b"MSG s 1 3\r\nbad\r\nMSG s 1 2\r\nok\r\n")
        return got, errors

    got, errors = asyncio.run(run())
    assert got == [b"ok"]
    assert [str(exc) for exc in errors] == ["refused"]


def test_info_is_handed_over_as_json() -> None:
    info = {"server_id": "x", "headers": True}
    calls = _parsed(GroveParser, b"INFO " + json.dumps(info).encode() + b"\r\n", [])
    assert calls == [("info", info)]


async def _sent(publish: Any) -> list[bytes]:
    """The commands an unconnected GroveConnection queues for `publish(nc)`."""
    nc = GroveConnection()
    nc._max_pending_size = 2 * 1024 * 1024  # as `connect` sets it by default
    sent: list[bytes] = []

    async def send_command(command: bytes, priority: bool = False) -> None:
        sent.append(command)

    nc._send_command = send_command  # type: ignore[method-assign]
    await publish(nc)
    return sent


# Text that UTF-8 can encode (a lone surrogate cannot: nats-py and `header_block` both raise).
header_values = st.text(
    st.characters(blacklist_characters="\r\n", blacklist_categories=("Cs",)), max_size=20
).map(str.strip)
header_dicts = st.dictionaries(st.sampled_from(["Nats-Msg-Id", "A", "x-y"]), header_values)


@given(header_dicts, st.binary(max_size=40))
def test_a_headed_publish_sends_what_nats_py_sends(headers: dict[str, str], payload: bytes) -> None:
    ours = asyncio.run(
        _sent(
            lambda nc: nc.publish_headed("grove.a.b", "_INBOX.x.1", header_block(headers), payload)
        )
    )
    theirs = asyncio.run(
        _sent(lambda nc: nc.publish("grove.a.b", payload, reply="_INBOX.x.1", headers=headers))
    )
    assert ours == theirs


@pytest.mark.parametrize(
    "headers", [{"A": "one\r\ntwo"}, {"A": "x\n"}, {"B:C": "1"}, {"": "1"}, {"A\r\n": "1"}]
)
def test_headers_that_would_break_the_block_are_refused(headers: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="cannot be sent"):
        header_block(headers)


def test_a_headed_publish_checks_the_payload_size_and_the_connection() -> None:
    async def too_large(nc: GroveConnection) -> None:
        await nc.publish_headed("s", "r", header_block({}), b"x" * (nc._max_payload + 1))

    async def closed(nc: GroveConnection) -> None:
        nc._status = GroveConnection.CLOSED
        await nc.publish_headed("s", "r", header_block({}), b"x")

    with pytest.raises(MaxPayloadError):
        asyncio.run(_sent(too_large))
    with pytest.raises(ConnectionClosedError):
        asyncio.run(_sent(closed))

"""The event log's connection reads message headers exactly as nats-py does, only faster."""

from __future__ import annotations

import marshal

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from nats.aio.client import Client

from grove_core import connection
from grove_core.catchup import _records, _sent_headers
from grove_core.connection import GroveConnection, LazyHeaders, parse_header_lines

pytestmark = pytest.mark.unit

#: Bytes that make header parsing interesting: separators, ASCII and Unicode whitespace (in
#: UTF-8 too), bytes that are not ASCII, and invalid UTF-8.
PIECES = [
    b"Nats-Msg-Id", b"Nats-Expected-Last-Subject-Sequence", b"X", b"a b", b":", b": ", b" ",
    b"\t", b"\r", b"\n", b"\r\n", b"\x0b", b"\x1c", b"\x85", b"\xc2\x85", b"\xe2\x80\x83",
    b"\xff", b"\xc3\xa9", b"value", b"12345", b"", b"grove.*.a", b"a\tb", b"\x1cc", b"d\x0be",
]  # fmt: skip

header_blocks = st.lists(
    st.lists(st.sampled_from(PIECES) | st.binary(max_size=6), max_size=6).map(b"".join),
    max_size=6,
).map(b"\r\n".join)


@given(header_blocks)
@example(b"a\tb: 1\r\n\x1cc: 2\r\nd\x0be: 3\r\n f : 4\r\n: 5\r\n\xc3\xa9: 6\r\ng: \xff")
def test_the_same_headers_as_nats_py(raw: bytes) -> None:
    expected = Client._parse_header_lines(raw)
    # Twice: the first parse checks the names, the second takes them as remembered.
    assert parse_header_lines(raw) == expected
    assert parse_header_lines(raw) == expected


def test_a_guarded_event_s_headers() -> None:
    raw = (
        b"Nats-Msg-Id: 0193\r\nNats-Expected-Last-Subject-Sequence: 7\r\n"
        b"Nats-Expected-Last-Subject-Sequence-Subject: grove.*.a\r\n\r\n"
    )
    assert parse_header_lines(raw) == {
        "Nats-Msg-Id": "0193",
        "Nats-Expected-Last-Subject-Sequence": "7",
        "Nats-Expected-Last-Subject-Sequence-Subject": "grove.*.a",
    }


def test_names_past_the_limit_are_still_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(connection, "_known_names", {})
    monkeypatch.setattr(connection, "KNOWN_NAMES_MAX", 2)
    raw = b"\r\n".join(f"Name-{i}: {i}".encode() for i in range(5))
    assert parse_header_lines(raw) == {f"Name-{i}": str(i) for i in range(5)}
    assert len(connection._known_names) == 2


def test_the_connection_uses_it() -> None:
    # nats-py calls this static method for every message with headers; an upgrade of nats-py
    # that renamed it would leave the connection silently on the slow parse.
    assert "_parse_header_lines" in vars(Client)
    assert GroveConnection._parse_header_lines is parse_header_lines


@given(header_blocks)
def test_lazy_headers_are_the_parsed_ones_once_read(raw: bytes) -> None:
    headers = LazyHeaders(raw)
    assert headers._parsed is None  # nothing parsed until asked
    assert headers == parse_header_lines(raw)
    assert dict(headers) == parse_header_lines(raw)
    assert len(headers) == len(parse_header_lines(raw))


def test_lazy_headers_cross_the_catch_up_pipe_unparsed() -> None:
    lines = b"Nats-Msg-Id: 0193\r\n\r\n"
    sent = _sent_headers(LazyHeaders(lines))
    assert sent == lines
    assert _sent_headers({"K": "v"}) == {"K": "v"}
    assert _sent_headers(None) is None
    body = marshal.dumps([(1, "grove.spawn.a", b"{}", 1_700_000_000_000, sent, 0)])
    (record,) = _records(body)
    assert isinstance(record.headers, LazyHeaders)
    assert record.headers == {"Nats-Msg-Id": "0193"}

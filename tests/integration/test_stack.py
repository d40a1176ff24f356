"""The local stack's start-up: a service whose HTTP port was taken between the choice of a
free port and its start is moved to another one instead of failing the start, also when what
took the port answers like a ready service."""

from __future__ import annotations

import http.server
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import agentgrove.stack
from agentgrove.stack import Stack
from grove_core.natsserver import free_port
from tests.conftest import NatsEndpoint

pytestmark = pytest.mark.integration


def test_a_service_whose_port_was_taken_moves_to_another(
    nats_server: NatsEndpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    taken_port = taken.getsockname()[1]

    first_port_is(monkeypatch, taken_port)
    try:
        assert_one_service_moved_from(
            Stack(tmp_path / "stack", nats_url=nats_server.url), taken_port
        )
    finally:
        taken.close()


class _AnotherReadyService(http.server.BaseHTTPRequestHandler):
    """Answers every GET as a ready service would, with its own process id."""

    def do_GET(self) -> None:
        body = json.dumps({"ready": True, "service": "another", "pid": 1}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


def test_a_port_answered_by_another_ready_service_is_not_taken_for_this_one(
    nats_server: NatsEndpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Tests side by side run stacks of their own: the port a service was given may be one
    # where another stack's service already answers /readyz with 200.
    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _AnotherReadyService)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        first_port_is(monkeypatch, other.server_address[1])
        assert_one_service_moved_from(
            Stack(tmp_path / "stack", nats_url=nats_server.url), other.server_address[1]
        )
    finally:
        other.shutdown()
        other.server_close()


def first_port_is(monkeypatch: pytest.MonkeyPatch, port: int) -> None:
    """The stack's first service is given `port`; the others ports chosen freely."""

    def ports() -> Iterator[int]:
        yield port
        while True:
            yield free_port()

    chosen = ports()
    monkeypatch.setattr(agentgrove.stack, "free_port", lambda: next(chosen))


def assert_one_service_moved_from(stack: Stack, port: int) -> None:
    """Start `stack`: one service must find `port` taken and move, and every service must be
    ready, answering from its own process."""
    try:
        stack.start()
        moved = [s for s in stack.services.values() if "address already in use" in
                 s.log_path.read_text()]  # fmt: skip
        assert len(moved) == 1
        assert moved[0].http_port != port
        assert all(service.ready() for service in stack.services.values())
    finally:
        stack.stop()

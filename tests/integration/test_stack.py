"""The local stack's start-up: a service whose HTTP port was taken between the choice of a
free port and its start is moved to another one instead of failing the start."""

from __future__ import annotations

import socket
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

    def ports() -> Iterator[int]:
        yield taken_port  # the first service's: in use by the time it starts
        while True:
            yield free_port()

    chosen = ports()
    monkeypatch.setattr(agentgrove.stack, "free_port", lambda: next(chosen))
    stack = Stack(tmp_path / "stack", nats_url=nats_server.url)
    try:
        stack.start()
        moved = [s for s in stack.services.values() if "address already in use" in
                 s.log_path.read_text()]  # fmt: skip
        assert len(moved) == 1
        assert moved[0].http_port != taken_port
        assert all(service.ready() for service in stack.services.values())
    finally:
        stack.stop()
        taken.close()

"""Shared fixtures: one way to get a real nats-server, and the stack on top of it."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agentgrove.stack import Stack
from grove_core.log import EventLog
from grove_core.natsserver import LocalNatsServer

try:
    from testcontainers.community.nats import NatsContainer
except ImportError:  # testcontainers without its NATS module
    NatsContainer = None

log = logging.getLogger(__name__)


@dataclass
class NatsEndpoint:
    """A running NATS server for one test: its URL, and how to crash or restart it."""

    url: str
    server: LocalNatsServer | None

    def kill(self) -> None:
        """SIGKILL the server (only for a local one)."""
        assert self.server is not None, "only a local nats-server can be killed"
        self.server.kill()

    def restart(self) -> None:
        """Start the same server again, same port and store."""
        assert self.server is not None
        self.server.start()


def _docker_nats() -> contextlib.AbstractContextManager[str] | None:
    """A NATS container when a Docker engine answers, else None (the binary is used)."""
    if os.environ.get("GROVE_TEST_DOCKER", "auto") == "never":
        return None
    if NatsContainer is None:
        return None
    try:
        container = NatsContainer(jetstream=True)
    except Exception as exc:  # noqa: BLE001 - DockerException, or anything else: no engine
        log.debug("no Docker engine (%s); using the nats-server binary", exc)
        return None

    @contextlib.contextmanager
    def running() -> Iterator[str]:
        with container as started:
            yield started.nats_uri()

    return running()


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsEndpoint]:
    """A real nats-server with JetStream on 127.0.0.1, a free port and a temporary store."""
    docker = _docker_nats() if os.environ.get("GROVE_TEST_DOCKER") == "always" else None
    if docker is not None:
        with docker as url:
            yield NatsEndpoint(url, None)
        return
    server = LocalNatsServer(tmp_path / "nats").start()
    try:
        yield NatsEndpoint(server.url, server)
    finally:
        server.stop()


@pytest.fixture
async def event_log(nats_server: NatsEndpoint) -> AsyncIterator[EventLog]:
    """A connected EventLog with the GROVE stream created."""
    log = await EventLog.connect(nats_server.url, name="test")
    await log.ensure_stream()
    try:
        yield log
    finally:
        await log.close()


StackFactory = Callable[..., Stack]


@pytest.fixture
def make_stack(nats_server: NatsEndpoint, tmp_path: Path) -> Iterator[StackFactory]:
    """Start the services as processes against the test's nats-server."""
    stacks: list[Stack] = []

    def factory(
        *, spawners: int = 1, config: str | None = None, name: str = "stack", **env: str
    ) -> Stack:
        data_dir = tmp_path / name
        data_dir.mkdir(parents=True, exist_ok=True)
        config_file = None
        if config is not None:
            config_file = data_dir / "grove.yaml"
            config_file.write_text(config)
        stack = Stack(
            data_dir,
            nats_url=nats_server.url,
            spawners=spawners,
            config_file=config_file,
            extra_env={"PYTHONPATH": str(Path(__file__).parent.parent), **env},
        )
        stacks.append(stack)
        return stack.start()

    try:
        yield factory
    finally:
        for stack in stacks:
            stack.stop()

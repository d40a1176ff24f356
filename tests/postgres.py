"""A throwaway PostgreSQL server for tests: this machine's own binaries, 127.0.0.1, a free port,
a temporary data folder, ended by its process id.

PostgreSQL refuses to run as root; run by root, the server runs as `nobody`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg

#: Seconds the server has to accept connections after it starts.
START_WITHIN_S = 30.0
#: Ports tried, each chosen afresh, before a start that finds its port taken gives up.
PORT_ATTEMPTS = 5
#: The superuser `initdb` makes (no password: only 127.0.0.1 reaches the server).
SUPERUSER = "grove"


def postgres_bin_dir() -> Path | None:
    """The folder holding `initdb` and `postgres` (PATH first, then Debian's layout)."""
    found = shutil.which("initdb")
    candidates = [Path(found).resolve().parent] if found else []
    candidates += sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)
    for folder in candidates:
        if (folder / "initdb").exists() and (folder / "postgres").exists():
            return folder
    return None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class LocalPostgres:
    """One PostgreSQL server; `database()` makes a fresh database and gives its URL."""

    def __init__(self, bin_dir: Path) -> None:
        self.bin_dir = bin_dir
        self.port = _free_port()
        self.folder = Path(tempfile.mkdtemp(prefix="grove-pg-"))
        self.user = "nobody" if os.geteuid() == 0 else None
        self.process: subprocess.Popen[bytes] | None = None
        self._databases = 0

    def start(self) -> LocalPostgres:
        """Make the cluster and start the server. Another process may bind the chosen port
        before the server does (tests run side by side); then it starts again on another."""
        if self.user is not None:
            shutil.chown(self.folder, self.user)
        initdb = [str(self.bin_dir / "initdb"), "-D", str(self.folder / "data"), "-U", SUPERUSER]
        with (self.folder / "server.log").open("ab") as log:
            subprocess.run(
                [*initdb, "-A", "trust", "-E", "UTF8", "--no-sync"],
                check=True,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.folder,
                user=self.user,
            )
        for _ in range(PORT_ATTEMPTS - 1):
            log_offset = (self.folder / "server.log").stat().st_size
            try:
                return self._start_once()
            except RuntimeError:
                said = (self.folder / "server.log").read_bytes()[log_offset:]
                if b"Address already in use" not in said:
                    raise
            self.port = _free_port()
        return self._start_once()

    def _start_once(self) -> LocalPostgres:
        """Start the server on `self.port` and wait until it answers."""
        server = [
            str(self.bin_dir / "postgres"),
            "-D",
            str(self.folder / "data"),
            "-h",
            "127.0.0.1",
        ]
        with (self.folder / "server.log").open("ab") as log:
            self.process = subprocess.Popen(
                [*server, "-p", str(self.port), "-k", str(self.folder), "-c", "fsync=off"],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.folder,
                user=self.user,
            )
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_WITHIN_S
        while True:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"postgres exited: {self.log_tail()}")
            try:
                with psycopg.connect(self.dsn("postgres"), connect_timeout=2):
                    return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"postgres did not start: {self.log_tail()}") from None
                time.sleep(0.1)

    def dsn(self, database: str) -> str:
        return f"host=127.0.0.1 port={self.port} user={SUPERUSER} dbname={database}"

    def database(self, prefix: str = "grove") -> str:
        """A new empty database; its SQLAlchemy URL."""
        self._databases += 1
        name = f"{prefix}_{os.getpid()}_{self._databases}"
        with psycopg.connect(self.dsn("postgres"), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return f"postgresql+psycopg://{SUPERUSER}@127.0.0.1:{self.port}/{name}"

    def log_tail(self, lines: int = 20) -> str:
        path = self.folder / "server.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """Fast shutdown (SIGINT), SIGKILL after 10 s; the data folder is deleted."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        with contextlib.suppress(OSError):
            shutil.rmtree(self.folder)

"""Service processes forked from a process that has imported the services already.

A service started as `python -m grove_spawner` spends about a second of CPU importing its
libraries before it does anything. A `Launcher` pays that once: it runs one launcher process
(`python -m agentgrove.launcher <module>...`) that imports the given modules, starts no thread,
and then forks a child for each service asked for. The child takes the environment, working
folder and log file it is given, and runs the service's module as `python -m` would. Each
child is a process of its own, with its own id, state and event loop.

The launcher process is the children's parent, so it is the one that reaps them; a
`ForkedProcess` asks it whether its child has exited. Used by the test suite, where hundreds
of stacks start; `grove up` and the benchmark start their services with `python -m`.

The protocol is one JSON object per line on the launcher's stdin and stdout:
`{"op": "start", "module", "env", "log", "cwd"}` → `{"pid"}`, and `{"op": "poll", "pid"}` →
`{"returncode"}` (null while the child runs).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

#: What a launcher for the four services imports before it forks.
SERVICE_IMPORTS = (
    "grove_governor.service",
    "grove_router.service",
    "grove_artifacts.service",
    "grove_spawner.service",
)
#: How often `ForkedProcess.wait` asks whether the child has exited.
POLL_PAUSE_S = 0.01
#: How long a launcher may take to import its modules and say it is ready.
READY_TIMEOUT_S = 60.0


class LauncherError(RuntimeError):
    """The launcher process could not start, or stopped answering."""


class Launcher:
    """One launcher process, and the children it forks on request (thread-safe)."""

    def __init__(
        self, modules: Sequence[str] = SERVICE_IMPORTS, env: Mapping[str, str] | None = None
    ) -> None:
        self.modules = tuple(modules)
        self._lock = threading.Lock()
        #: The launcher's own messages (its children write to their logs).
        self._errors = tempfile.TemporaryFile()  # noqa: SIM115 - closed by close()
        self._process = subprocess.Popen(
            [sys.executable, "-m", "agentgrove.launcher", *self.modules],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._errors,
            env={**(env if env is not None else os.environ), "PYTHONUNBUFFERED": "1"},
        )
        try:
            self._read(READY_TIMEOUT_S)
        except LauncherError:
            self.close()
            raise

    @property
    def pid(self) -> int:
        """The launcher process's id."""
        return self._process.pid

    def start(
        self,
        module: str,
        env: Mapping[str, str],
        log_path: Path,
        cwd: Path | None = None,
    ) -> ForkedProcess:
        """Fork a child that runs `module` as `python -m module` would, with `env` as its whole
        environment, its stdout and stderr appended to `log_path` and its stdin empty."""
        pid = self._ask(
            {
                "op": "start",
                "module": module,
                "env": dict(env),
                "log": str(log_path),
                "cwd": str(cwd or Path.cwd()),
            }
        )["pid"]
        return ForkedProcess(self, int(pid), module)

    def returncode(self, pid: int) -> int | None:
        """A child's exit code (negative: the signal that ended it), None while it runs."""
        code = self._ask({"op": "poll", "pid": pid})["returncode"]
        return None if code is None else int(code)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the launcher process (children still running go on, as orphans)."""
        with self._lock:
            if self._process.stdin is not None:
                with contextlib.suppress(OSError):
                    self._process.stdin.close()
            try:
                self._process.wait(timeout)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(timeout)
            if self._process.stdout is not None:
                self._process.stdout.close()
            self._errors.close()

    def __enter__(self) -> Launcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            stdin = self._process.stdin
            if stdin is None or stdin.closed:
                raise LauncherError("the launcher is closed")
            try:
                stdin.write(json.dumps(request).encode() + b"\n")
                stdin.flush()
            except OSError as exc:
                raise LauncherError(f"the launcher process is gone: {exc}") from None
            answer = self._read(None)
        if "error" in answer:
            raise LauncherError(str(answer["error"]))
        return answer

    def _read(self, timeout: float | None) -> dict[str, Any]:
        stdout = self._process.stdout
        assert stdout is not None
        line = _readline(stdout, timeout)
        if not line:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(5)
            self._errors.seek(0)
            said = self._errors.read()[-2000:].decode(errors="replace").strip()
            raise LauncherError(
                f"the launcher process exited (code {self._process.returncode}) without "
                f"answering: {said or '(it said nothing)'}"
            )
        answer: dict[str, Any] = json.loads(line)
        return answer


def _readline(stream: IO[bytes], timeout: float | None) -> bytes:
    """A line from `stream`; with `timeout`, from a thread, so that a launcher that hangs while
    it imports does not hang its caller."""
    if timeout is None:
        return stream.readline()
    result: list[bytes] = []
    reader = threading.Thread(target=lambda: result.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if reader.is_alive():
        raise LauncherError(f"the launcher did not say it was ready within {timeout} s")
    return result[0]


class ForkedProcess:
    """A child of a `Launcher`, with the parts of `subprocess.Popen` a stack uses."""

    def __init__(self, launcher: Launcher, pid: int, module: str) -> None:
        self.launcher = launcher
        self.pid = pid
        self.args = [sys.executable, "-m", module]
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The exit code once the child has exited, else None."""
        if self.returncode is None:
            self.returncode = self.launcher.returncode(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait until the child exits; subprocess.TimeoutExpired after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(POLL_PAUSE_S)
        return code

    def send_signal(self, sig: int) -> None:
        """Signal the child, unless it has exited (its id may belong to another process)."""
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        """SIGKILL."""
        self.send_signal(signal.SIGKILL)


# -- the launcher process -----------------------------------------------------------------


def serve(modules: Sequence[str]) -> None:
    """Import `modules`, then fork a child per `start` request until stdin closes."""
    for module in modules:
        importlib.import_module(module)
    if threading.active_count() != 1:
        raise SystemExit(f"a launcher may not fork with threads running: {threading.enumerate()}")
    requests = os.fdopen(os.dup(0), "rb")
    answers = os.dup(1)
    quiet = os.open(os.devnull, os.O_RDWR)
    os.dup2(quiet, 0)
    os.dup2(2, 1)  # a stray print must not break the protocol
    os.close(quiet)
    exited: dict[int, int] = {}
    _answer(answers, {"ready": True, "pid": os.getpid()})
    for line in requests:
        _reap(exited)
        request = json.loads(line)
        if request["op"] == "start":
            try:  # here, so that a bad path is an answer, not a child that dies unheard
                log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            except OSError as exc:
                _answer(answers, {"error": f"cannot open the log {request['log']}: {exc}"})
                continue
            pid = os.fork()
            if pid == 0:
                requests.close()
                os.close(answers)
                _become(request, log)  # runs the service; its exit ends this process
                return
            os.close(log)
            exited.pop(pid, None)  # an id reused by the system: not the old child's exit
            _answer(answers, {"pid": pid})
        elif request["op"] == "poll":
            _answer(answers, {"returncode": exited.get(int(request["pid"]))})
        else:
            _answer(answers, {"error": f"unknown op {request['op']!r}"})


def _answer(fd: int, answer: dict[str, Any]) -> None:
    os.write(fd, json.dumps(answer).encode() + b"\n")


def _reap(exited: dict[int, int]) -> None:
    """Collect the exit codes of every child that has exited."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        exited[pid] = os.waitstatus_to_exitcode(status)


def _become(request: dict[str, Any], log: int) -> None:
    """In a forked child: take the request's environment, folder and log, then run the module
    as `python -m` does (its SystemExit, or an exception, ends the process)."""
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    env: dict[str, str] = request["env"]
    os.environ.clear()
    os.environ.update(env)
    for entry in reversed(env.get("PYTHONPATH", "").split(os.pathsep)):
        if entry and entry not in sys.path:
            sys.path.insert(0, entry)
    os.chdir(request["cwd"])
    sys.argv[:] = [request["module"]]
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    serve(sys.argv[1:])

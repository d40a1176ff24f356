"""Runtimes: where an agent actually runs, behind one small interface.

A runtime turns an agent instance (an `AgentRun`) into an `Outcome`. Stopping is cancellation:
the runtime cleans up (a subprocess is terminated, then killed) and lets `CancelledError`
through. Pausing goes through the run (`AgentRun.pause`), as far as the runtime allows.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import importlib
import inspect
import json
import os
import shlex
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from agentgrove.context import AgentContext, AgentSession, StartKind
from grove_events import SpawnEvent

#: The spawner's own NATS credentials: never passed on to the processes of agents (they get
#: the agent credentials of the spawner's settings, in `AgentRun.env`).
SERVICE_CREDENTIALS = frozenset({"GROVE_NATS_USER", "GROVE_NATS_PASSWORD", "GROVE_NATS_CREDS"})
#: How long a stopped subprocess gets to exit after SIGTERM before SIGKILL.
STOP_GRACE_S = 5.0
#: How much of a failed command's stderr goes into the error.
STDERR_TAIL = 2000
#: Least time between two `assistant` entries recorded from a command's stdout.
RECORD_INTERVAL_S = 1.0
READ_CHUNK = 65536


@dataclass(frozen=True)
class Outcome:
    """How an agent's run ended (a stop is a cancellation, not an outcome)."""

    completed: bool
    summary: str = ""
    error: str | None = None
    attempted: list[str] = field(default_factory=list)
    partial_results: list[str] = field(default_factory=list)
    tokens: int = 0


@dataclass
class AgentRun:
    """One instance of an agent, as its runtime sees it, and its pause switch.

    `message` is what the instance starts with besides its task: the resume message, or a
    fork's initial message. Pausing holds a python agent at its next AgentGrove call and
    stops a command's process group (SIGSTOP) until it is resumed (SIGCONT).
    """

    spawn: SpawnEvent
    context: AgentContext
    session: AgentSession
    env: dict[str, str]
    start: StartKind = "spawn"
    message: str | None = None
    #: The directory the agent works in: its process's working directory, and for an ACP
    #: agent the bound of the files and terminals it is served.
    workspace: Path = field(default_factory=Path.cwd)
    paused: bool = False
    process: asyncio.subprocess.Process | None = field(default=None, repr=False)

    def attach(self, process: asyncio.subprocess.Process) -> None:
        """The run's process, as soon as it exists (stopped at once if the run is paused)."""
        self.process = process
        if self.paused:
            self._signal(signal.SIGSTOP)

    def pause(self) -> bool:
        """Pause the run; False when it already was."""
        if self.paused:
            return False
        self.paused = True
        self.context.pause()
        self._signal(signal.SIGSTOP)
        return True

    def resume(self) -> bool:
        """Let a paused run go on; False when it was not paused."""
        if not self.paused:
            return False
        self.paused = False
        self._signal(signal.SIGCONT)
        self.context.unpause()
        return True

    def _signal(self, sig: int) -> None:
        if self.process is not None and self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, sig)


class Runtime(Protocol):
    """Runs one agent instance to its outcome."""

    name: str

    async def run(self, run: AgentRun) -> Outcome:
        """Run the agent; raise CancelledError through when stopped."""
        ...


def process_environment(run: AgentRun) -> dict[str, str]:
    """The environment of an agent's process: the spawner's, without its own credentials,
    and the run's (the agent's id, the NATS URL, the agent credentials)."""
    inherited = {k: v for k, v in os.environ.items() if k not in SERVICE_CREDENTIALS}
    return {**inherited, **run.env}


def _as_text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, default=str)
    except (TypeError, ValueError):
        return str(value)


class PythonRuntime:
    """`config.entrypoint = "module:function"`, an async function given an AgentContext."""

    name = "python"

    @staticmethod
    def load(entrypoint: str) -> Callable[[AgentContext], Awaitable[Any]]:
        """Import the entrypoint; ValueError with the reason when it cannot be used."""
        module_name, _, attr = entrypoint.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ValueError(f"cannot import {module_name!r}: {exc}") from None
        function = getattr(module, attr, None)
        if function is None:
            raise ValueError(f"module {module_name!r} has no {attr!r}")
        if not inspect.iscoroutinefunction(function):
            raise ValueError(f"{entrypoint} must be an async function taking an AgentContext")
        return function  # type: ignore[no-any-return]

    async def run(self, run: AgentRun) -> Outcome:
        """Call the entrypoint with the run's AgentContext; what it returns is the summary."""
        entrypoint = run.spawn.config.entrypoint
        assert entrypoint is not None
        context = run.context
        try:
            function = self.load(entrypoint)
        except ValueError as exc:
            return Outcome(completed=False, error=str(exc))
        try:
            result = await function(context)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure of agent code is its outcome
            return Outcome(
                completed=False,
                error=f"{exc.__class__.__name__}: {exc}",
                attempted=list(context.attempted),
                partial_results=list(context.partial_results),
                tokens=context.tokens,
            )
        return Outcome(completed=True, summary=_as_text(result), tokens=context.tokens)


class CommandRuntime:
    """`config.command = [argv...]`: a subprocess in its own process group.

    Its input on stdin is the task, or for a resumed or forked instance the message it starts
    with (the task is in GROVE_TASK, the session in GROVE_SESSION_ID); stdout is the result.
    The session records stdout as `assistant` entries while the command runs. A failure (a
    non-zero exit, or a command that cannot be executed) reports the command line as what was
    attempted and the stdout produced until then as the partial result.
    """

    name = "command"

    async def run(self, run: AgentRun) -> Outcome:
        """Run the command to its exit."""
        spawn = run.spawn
        argv = spawn.config.command
        assert argv is not None
        child_env = {
            **process_environment(run),
            "GROVE_TASK": spawn.task,
            "GROVE_SESSION_ID": spawn.session_id or spawn.agent_id,
            "GROVE_START": run.start,
        }
        if run.message is not None:
            child_env["GROVE_MESSAGE"] = run.message
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=child_env,
                cwd=run.workspace,
                start_new_session=True,
            )
        except OSError as exc:
            return Outcome(
                completed=False,
                error=f"cannot execute {argv[0]!r}: {exc.strerror}",
                attempted=[shlex.join(argv)],
            )
        run.attach(proc)
        assert proc.stdin is not None
        assert proc.stdout is not None
        assert proc.stderr is not None
        stdin_text = run.message if run.message is not None else spawn.task
        output: list[str] = []
        try:
            _, _, stderr = await asyncio.gather(
                _feed(proc.stdin, stdin_text.encode()),
                _record_output(proc.stdout, run.session, output),
                proc.stderr.read(),
            )
            await proc.wait()
        except (asyncio.CancelledError, Exception):
            await _end_process(proc)
            raise
        out = "".join(output)
        if proc.returncode == 0:
            return Outcome(completed=True, summary=out)
        tail = stderr.decode(errors="replace")[-STDERR_TAIL:].strip()
        return Outcome(
            completed=False,
            error=f"exit code {proc.returncode}" + (f": {tail}" if tail else ""),
            attempted=[shlex.join(argv)],
            partial_results=[out] if out else [],
        )


async def _feed(stdin: asyncio.StreamWriter, data: bytes) -> None:
    """Write the input and close stdin; a command that does not read it, or has already
    exited (its pipe closed), is fine."""
    gone = (BrokenPipeError, ConnectionResetError, RuntimeError)
    with contextlib.suppress(*gone):
        if not stdin.is_closing():
            stdin.write(data)
            await stdin.drain()
    with contextlib.suppress(*gone):
        stdin.close()
        await stdin.wait_closed()


async def _record_output(
    stdout: asyncio.StreamReader, session: AgentSession, output: list[str]
) -> None:
    """Collect stdout into `output`; record whole lines as `assistant` entries, at most one
    entry per RECORD_INTERVAL_S, and the rest at the end."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    pending = ""
    last = time.monotonic()
    while data := await stdout.read(READ_CHUNK):
        text = decoder.decode(data)
        output.append(text)
        pending += text
        if "\n" in pending and time.monotonic() - last >= RECORD_INTERVAL_S:
            head, _, pending = pending.rpartition("\n")
            await session.record("assistant", head + "\n")
            last = time.monotonic()
    tail = decoder.decode(b"", final=True)
    output.append(tail)
    pending += tail
    if pending:
        await session.record("assistant", pending)


async def _end_process(proc: asyncio.subprocess.Process) -> None:
    """SIGTERM the process group, SIGKILL it after the grace period."""
    if proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
        os.killpg(proc.pid, signal.SIGCONT)  # a paused process acts on SIGTERM only once running
    try:
        await asyncio.wait_for(proc.wait(), STOP_GRACE_S)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()


def _openai_runtime() -> Runtime:
    from grove_spawner.openai_runtime import OpenAIRuntime  # noqa: PLC0415

    return OpenAIRuntime()


def _acp_runtime() -> Runtime:
    from grove_spawner.acp_runtime import AcpRuntime  # noqa: PLC0415

    return AcpRuntime()


#: How to make each runtime, by name. The openai and acp runtimes are modules of their own that
#: import their client libraries, which took about 0.75 s of the 1.7 s a spawner spent importing:
#: they are imported when an agent first needs them.
RUNTIME_FACTORIES: dict[str, Callable[[], Runtime]] = {
    "python": PythonRuntime,
    "command": CommandRuntime,
    "openai": _openai_runtime,
    "acp": _acp_runtime,
}


class Runtimes:
    """The runtimes of one spawner, each made at its first use."""

    def __init__(self, factories: dict[str, Callable[[], Runtime]] | None = None) -> None:
        self.factories = RUNTIME_FACTORIES if factories is None else factories
        self._made: dict[str, Runtime] = {}

    @property
    def names(self) -> list[str]:
        """Every runtime this spawner can run agents in."""
        return list(self.factories)

    async def get(self, name: str) -> Runtime | None:
        """The runtime called `name` (None when there is none). Its first use imports its
        module in a thread, so that the agents already running go on meanwhile."""
        made = self._made.get(name)
        if made is not None:
            return made
        factory = self.factories.get(name)
        if factory is None:
            return None
        runtime = await asyncio.to_thread(factory)
        return self._made.setdefault(name, runtime)

"""Runtimes: where an agent actually runs, behind one small interface.

A runtime turns an admitted agent into an `Outcome`. Stopping is cancellation: the runtime
cleans up (a subprocess is terminated, then killed) and lets `CancelledError` through.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import json
import os
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from agentgrove.context import AgentContext
from grove_events import SpawnEvent

#: How long a stopped subprocess gets to exit after SIGTERM before SIGKILL.
STOP_GRACE_S = 5.0
#: How much of a failed command's stderr goes into the error.
STDERR_TAIL = 2000


@dataclass(frozen=True)
class Outcome:
    """How an agent's run ended (a stop is a cancellation, not an outcome)."""

    completed: bool
    summary: str = ""
    error: str | None = None
    attempted: list[str] = field(default_factory=list)
    partial_results: list[str] = field(default_factory=list)
    tokens: int = 0


class Runtime(Protocol):
    """Runs one agent to its outcome."""

    name: str

    async def run(self, spawn: SpawnEvent, context: AgentContext, env: dict[str, str]) -> Outcome:
        """Run the agent; raise CancelledError through when stopped."""
        ...


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

    async def run(self, spawn: SpawnEvent, context: AgentContext, env: dict[str, str]) -> Outcome:
        assert spawn.config.entrypoint is not None
        try:
            function = self.load(spawn.config.entrypoint)
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
            )
        return Outcome(completed=True, summary=_as_text(result))


class CommandRuntime:
    """`config.command = [argv...]`: the task on stdin and in GROVE_TASK, stdout the result."""

    name = "command"

    async def run(self, spawn: SpawnEvent, context: AgentContext, env: dict[str, str]) -> Outcome:
        assert spawn.config.command is not None
        argv = spawn.config.command
        child_env = {**os.environ, **env, "GROVE_TASK": spawn.task}
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=child_env,
                start_new_session=True,
            )
        except OSError as exc:
            return Outcome(completed=False, error=f"cannot execute {argv[0]!r}: {exc.strerror}")
        try:
            stdout, stderr = await _exchange(proc, spawn.task.encode())
        except asyncio.CancelledError:
            await _end_process(proc)
            raise
        out = stdout.decode(errors="replace")
        if proc.returncode == 0:
            return Outcome(completed=True, summary=out)
        tail = stderr.decode(errors="replace")[-STDERR_TAIL:].strip()
        return Outcome(
            completed=False,
            error=f"exit code {proc.returncode}" + (f": {tail}" if tail else ""),
            attempted=[" ".join(argv)],
            partial_results=[out] if out else [],
        )


async def _exchange(proc: asyncio.subprocess.Process, data: bytes) -> tuple[bytes, bytes]:
    """Write `data` to stdin (a command that never reads it is fine), collect stdout/stderr."""
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None

    async def feed(stdin: asyncio.StreamWriter) -> None:
        try:
            stdin.write(data)
            await stdin.drain()
        except (BrokenPipeError, ConnectionResetError, RuntimeError):
            pass  # the command exited or closed its stdin without reading the task
        finally:
            with contextlib.suppress(Exception):
                stdin.close()

    _, stdout, stderr = await asyncio.gather(
        feed(proc.stdin), proc.stdout.read(), proc.stderr.read()
    )
    await proc.wait()
    return stdout, stderr


async def _end_process(proc: asyncio.subprocess.Process) -> None:
    """SIGTERM the process group, SIGKILL it after the grace period."""
    if proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        await asyncio.wait_for(proc.wait(), STOP_GRACE_S)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()


RUNTIMES: dict[str, Runtime] = {"python": PythonRuntime(), "command": CommandRuntime()}

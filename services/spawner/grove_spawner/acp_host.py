"""What the spawner serves an ACP agent: text files and terminals, each only within the
agent's permissions and inside its workspace.

The capabilities have the names used everywhere in AgentGrove (a spawn's `permissions`, the
grants of approved `permission` requests):

- `fs.read`: `fs/read_text_file` of a file inside the workspace;
- `fs.write`: `fs/write_text_file` inside the workspace (missing directories are made);
- `shell`: `terminal/*`: a command run inside the workspace, in its own process group, its
  output kept up to the byte limit the agent asks for (the newest output kept), killed when
  the agent releases it or its run ends.

What the agent holds when it starts is what `initialize` offers it; every request is checked
again when it comes, so a capability granted meanwhile is served and one never held is
refused with an ACP error naming it. Paths must be absolute (as ACP says) and stay inside the
workspace once symbolic links are resolved.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from acp import RequestError
from acp.schema import (
    ClientCapabilities,
    CreateTerminalResponse,
    EnvVariable,
    FileSystemCapabilities,
    KillTerminalResponse,
    ReadTextFileResponse,
    ReleaseTerminalResponse,
    TerminalExitStatus,
    TerminalOutputResponse,
    WaitForTerminalExitResponse,
    WriteTextFileResponse,
)

from agentgrove.context import AgentContext

#: The capability a permission request for a tool call of each ACP kind needs.
TOOL_CAPABILITIES = {
    "read": "fs.read",
    "search": "fs.read",
    "edit": "fs.write",
    "delete": "fs.write",
    "move": "fs.write",
    "execute": "shell",
    "fetch": "net",
}
#: JSON-RPC error code of a request the agent's permissions do not allow.
NOT_PERMITTED = -32003
#: Output kept of a terminal whose creator names no byte limit.
DEFAULT_OUTPUT_LIMIT = 1_000_000
#: How long a killed terminal's process group gets after SIGTERM before SIGKILL.
TERMINAL_KILL_GRACE_S = 2.0
READ_CHUNK = 65536


def not_permitted(capability: str, agent_id: str, what: str) -> RequestError:
    return RequestError(
        NOT_PERMITTED,
        "Not permitted",
        {
            "capability": capability,
            "reason": f"agent {agent_id} does not hold {capability!r}: {what}",
        },
    )


class Workspace:
    """The directory an agent's files and terminals are confined to."""

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()

    def path(self, raw: str) -> Path:
        """The resolved path; an ACP `invalid params` error when it is relative or outside."""
        given = Path(raw)
        if not given.is_absolute():
            raise RequestError.invalid_params({"path": raw, "reason": "the path is not absolute"})
        resolved = given.resolve()
        if not resolved.is_relative_to(self.root):
            raise RequestError.invalid_params(
                {"path": raw, "reason": f"outside the agent's workspace {self.root}"}
            )
        return resolved


def read_lines(path: Path, line: int | None, limit: int | None) -> str:
    """The file's text, from 1-based `line`, at most `limit` lines."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        raise RequestError.resource_not_found(str(path)) from None
    except IsADirectoryError:
        raise RequestError.invalid_params({"path": str(path), "reason": "a directory"}) from None
    if line is None and limit is None:
        return text
    lines = text.splitlines(keepends=True)
    start = max((line or 1) - 1, 0)
    end = None if limit is None else start + max(limit, 0)
    return "".join(lines[start:end])


def write_text(path: Path, content: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content, encoding="utf-8")


@dataclass
class Terminal:
    """One command an agent runs, and the output kept of it."""

    process: asyncio.subprocess.Process
    limit: int
    output: bytearray = field(default_factory=bytearray)
    truncated: bool = False
    reader: asyncio.Task[None] | None = None

    async def read(self) -> None:
        assert self.process.stdout is not None
        while chunk := await self.process.stdout.read(READ_CHUNK):
            self.output += chunk
            if len(self.output) > self.limit:
                del self.output[: len(self.output) - self.limit]
                self.truncated = True

    def text(self) -> str:
        data = bytes(self.output)
        if self.truncated:
            # The cut may have split a character: start at the first whole one.
            while data and data[0] & 0xC0 == 0x80:
                data = data[1:]
        return data.decode("utf-8", errors="replace")

    def exit_status(self) -> TerminalExitStatus | None:
        code = self.process.returncode
        if code is None:
            return None
        if code < 0:
            return TerminalExitStatus(signal=signal.Signals(-code).name)
        return TerminalExitStatus(exit_code=code)

    async def kill(self) -> None:
        if self.process.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(self.process.wait(), TERMINAL_KILL_GRACE_S)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            await self.process.wait()


class AcpHost:
    """Files and terminals for one agent instance, within its permissions and workspace."""

    def __init__(self, context: AgentContext, workspace: Path, env: dict[str, str]) -> None:
        self.context = context
        self.workspace = Workspace(workspace)
        self.env = env
        self.terminals: dict[str, Terminal] = {}
        self._next_terminal = 0

    async def capabilities(self) -> ClientCapabilities:
        """What to offer at `initialize`: what the agent holds now."""
        holds = self.context.has_permission
        return ClientCapabilities(
            fs=FileSystemCapabilities(
                read_text_file=await holds("fs.read"), write_text_file=await holds("fs.write")
            ),
            terminal=await holds("shell"),
        )

    async def _require(self, capability: str, what: str) -> None:
        if not await self.context.has_permission(capability):
            raise not_permitted(capability, self.context.agent_id, what)

    async def read_text_file(
        self, path: str, line: int | None = None, limit: int | None = None
    ) -> ReadTextFileResponse:
        await self._require("fs.read", f"read {path}")
        resolved = self.workspace.path(path)
        content = await asyncio.to_thread(read_lines, resolved, line, limit)
        return ReadTextFileResponse(content=content)

    async def write_text_file(self, path: str, content: str) -> WriteTextFileResponse:
        await self._require("fs.write", f"write {path}")
        resolved = self.workspace.path(path)
        await asyncio.to_thread(write_text, resolved, content)
        return WriteTextFileResponse()

    async def create_terminal(
        self,
        command: str,
        args: list[str] | None = None,
        env: list[EnvVariable] | None = None,
        cwd: str | None = None,
        output_byte_limit: int | None = None,
    ) -> CreateTerminalResponse:
        await self._require("shell", f"run {command}")
        directory = self.workspace.path(cwd) if cwd is not None else self.workspace.root
        variables = {**self.env, **{item.name: item.value for item in env or []}}
        try:
            process = await asyncio.create_subprocess_exec(
                command,
                *(args or []),
                cwd=directory,
                env=variables,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as exc:
            raise RequestError.invalid_params(
                {"command": command, "reason": exc.strerror or str(exc)}
            ) from None
        limit = DEFAULT_OUTPUT_LIMIT if output_byte_limit is None else max(output_byte_limit, 0)
        terminal = Terminal(process, limit)
        terminal.reader = asyncio.create_task(terminal.read())
        self._next_terminal += 1
        terminal_id = f"term-{self._next_terminal}"
        self.terminals[terminal_id] = terminal
        return CreateTerminalResponse(terminal_id=terminal_id)

    def _terminal(self, terminal_id: str) -> Terminal:
        terminal = self.terminals.get(terminal_id)
        if terminal is None:
            raise RequestError.invalid_params(
                {"terminalId": terminal_id, "reason": "no such terminal (released?)"}
            )
        return terminal

    async def terminal_output(self, terminal_id: str) -> TerminalOutputResponse:
        terminal = self._terminal(terminal_id)
        if terminal.process.returncode is not None and terminal.reader is not None:
            await terminal.reader  # everything it wrote before exiting
        return TerminalOutputResponse(
            output=terminal.text(),
            truncated=terminal.truncated,
            exit_status=terminal.exit_status(),
        )

    async def wait_for_terminal_exit(self, terminal_id: str) -> WaitForTerminalExitResponse:
        terminal = self._terminal(terminal_id)
        await terminal.process.wait()
        status = terminal.exit_status()
        assert status is not None
        return WaitForTerminalExitResponse(exit_code=status.exit_code, signal=status.signal)

    async def kill_terminal(self, terminal_id: str) -> KillTerminalResponse:
        await self._terminal(terminal_id).kill()
        return KillTerminalResponse()

    async def release_terminal(self, terminal_id: str) -> ReleaseTerminalResponse:
        terminal = self._terminal(terminal_id)
        del self.terminals[terminal_id]
        await terminal.kill()
        if terminal.reader is not None:
            terminal.reader.cancel()
        return ReleaseTerminalResponse()

    async def close(self) -> None:
        """Kill every terminal still there (the run is over)."""
        terminals = list(self.terminals.values())
        self.terminals.clear()
        for terminal in terminals:
            await terminal.kill()
            if terminal.reader is not None:
                terminal.reader.cancel()


def tool_capability(kind: Any) -> str | None:
    """The capability a tool call of this ACP kind needs (None: none known)."""
    return TOOL_CAPABILITIES.get(str(kind)) if kind is not None else None

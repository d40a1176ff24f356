"""What a process imports to start: the libraries only some agents or commands need are
imported when first needed. Each check runs a fresh interpreter, whose modules are its own."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from grove_spawner.runtimes import Runtimes

#: Libraries that take a large share of a start-up, each needed by one runtime or command.
OPTIONAL = ("openai", "acp", "mcp", "sqlalchemy")


def loaded_after(module: str) -> list[str]:
    """Which of `OPTIONAL` a fresh interpreter holds after importing `module`."""
    code = (
        f"import sys, json, {module}; "
        f"print(json.dumps([name for name in {OPTIONAL!r} if name in sys.modules]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    return list(json.loads(done.stdout))


def test_the_spawner_imports_the_model_runtimes_only_when_an_agent_needs_them() -> None:
    assert loaded_after("grove_spawner.service") == ["sqlalchemy"]


@pytest.mark.parametrize("module", ["agentgrove", "agentgrove.cli"])
def test_the_sdk_and_the_command_line_load_no_database_or_mcp_library(module: str) -> None:
    assert loaded_after(module) == []


async def test_a_runtime_is_made_at_its_first_use_and_kept() -> None:
    runtimes = Runtimes()
    assert runtimes.names == ["python", "command", "openai", "acp"]
    first = await runtimes.get("openai")
    assert first is not None
    assert first.name == "openai"
    assert await runtimes.get("openai") is first
    assert await runtimes.get("no-such-runtime") is None

"""`make run`: `grove demo` with no stack running starts its own in a temporary folder, runs
the demonstration tree (a python root, two explore subagents, a python writer and a command
agent), prints every result, stops the stack and removes the folder."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from grove_core.natsserver import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

#: The `grove` that `make run` runs: the virtual environment's, beside this Python.
GROVE = Path(sys.executable).parent / "grove"
#: "<short id> completed: <result>" in the demo's results.
RESULT = re.compile(r"^\s*(?P<agent>\S+) (?P<state>[a-z]+): (?P<result>.*)$")


def test_grove_demo_without_a_stack_runs_one_of_its_own_and_prints_every_result(
    tmp_path: Path,
) -> None:
    assert GROVE.is_file(), f"{GROVE} is missing: install with `pip install -e '.[dev]'`"
    temp = tmp_path / "temp"
    temp.mkdir()
    env = {
        key: value for key, value in os.environ.items() if not key.startswith(("GROVE_", "OPENAI_"))
    }
    # Where no stack answers, as on a fresh clone (a stack someone runs on the default port
    # here would otherwise be used); the demo's own stack is put in TMPDIR.
    env["GROVE_NATS_URL"] = f"nats://127.0.0.1:{free_port()}"
    env["TMPDIR"] = str(temp)

    run = subprocess.run(
        [str(GROVE), "demo", "--yes"],
        env=env,
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )

    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    started = re.search(r"no stack is reachable; starting one in (\S+) for the demo", out)
    assert started is not None, out
    folder = Path(started.group(1))
    assert folder.parent == temp
    assert "-- tree at seq" in out
    assert "answered automatically" in out
    block = out.split("\nresults:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    results = [RESULT.match(line) for line in block]
    assert all(results), block
    rows = [m.groupdict() for m in results if m is not None]
    assert [row["state"] for row in rows] == ["completed"] * 5, out
    root, *children = (row["result"] for row in rows)
    assert "as artifact" in root
    assert sum(child.startswith("Searched ") for child in children) == 2
    assert (
        sum(child.startswith("# What AgentGrove's documentation says") for child in children) == 1
    )
    tally = [child for child in children if child.startswith("tallied ")]
    assert len(tally) == 1, children
    assert re.fullmatch(
        r"tallied [1-9]\d* passages from [1-9]\d* documents: .*\.md \(\d+\).*", tally[0]
    )
    assert out.rstrip().endswith("grove: stopping the demo stack")
    assert not folder.exists()
    assert not any(temp.iterdir())
    assert (
        str(folder)
        not in subprocess.run(
            ["ps", "-A", "-o", "args="], capture_output=True, text=True, check=True
        ).stdout
    )

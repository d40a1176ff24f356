"""The `command` runtime through the spawner, against a real nats-server and the services: what a
command agent is given (its task on stdin and in GROVE_TASK) and how its failure is reported
(`terminate reason=failed`, and a `failed` status with `error`, `attempted`, `partial_results`).
"""

from __future__ import annotations

import asyncio
import json
import shlex
import sys

import pytest

from agentgrove.client import GroveClient, build_config
from grove_core.log import EventLog
from tests.conftest import StackFactory
from tests.integration.test_spawner_lifecycle import events, of, wait_ends

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def python_command(script: str) -> list[str]:
    """A command agent's argv: this Python running `script` (portable, no shell)."""
    return [sys.executable, "-c", script]


async def test_a_command_agent_reads_its_task_on_stdin_and_in_grove_task(
    make_stack: StackFactory, event_log: EventLog
) -> None:
    await asyncio.to_thread(make_stack)
    task = "count the words of\nthese two lines — «with unicode»"
    shows_its_input = python_command(
        "import json, os, sys\n"
        "print(json.dumps({'stdin': sys.stdin.read(), 'env': os.environ.get('GROVE_TASK')}))"
    )

    agent = await GroveClient(event_log).spawn(
        task, build_config("command", command=shows_its_input)
    )
    (ended,) = await wait_ends(event_log, agent)

    assert ended.reason == "completed", ended.error
    assert json.loads(ended.result.summary) == {"stdin": task, "env": task}


async def test_a_failed_command_reports_its_command_line_and_the_output_it_produced(
    make_stack: StackFactory, event_log: EventLog
) -> None:
    await asyncio.to_thread(make_stack)
    client = GroveClient(event_log)
    half_done = python_command(
        "import sys\n"
        "print('step 1 of 2: fetched the data', flush=True)\n"
        "print('step 2 of 2: the disk is full', file=sys.stderr)\n"
        "sys.exit(3)"
    )
    missing = ["/nonexistent/grove-agent", "--task", "with a space"]
    failing = await client.spawn("two steps", build_config("command", command=half_done))
    unrunnable = await client.spawn("never runs", build_config("command", command=missing))

    (failed_end,) = await wait_ends(event_log, failing)
    (unrunnable_end,) = await wait_ends(event_log, unrunnable)

    assert failed_end.reason == "failed"
    assert failed_end.error == "exit code 3: step 2 of 2: the disk is full"
    records = await events(event_log)
    (failed,) = of(records, failing, "status", "failed")
    assert failed.payload.details == {
        "error": "exit code 3: step 2 of 2: the disk is full",
        "attempted": [shlex.join(half_done)],
        "partial_results": ["step 1 of 2: fetched the data\n"],
    }
    assert unrunnable_end.reason == "failed"
    assert unrunnable_end.error is not None
    assert unrunnable_end.error.startswith("cannot execute '/nonexistent/grove-agent'")
    (never_ran,) = of(records, unrunnable, "status", "failed")
    assert never_ran.payload.details["attempted"] == [
        "/nonexistent/grove-agent --task 'with a space'"
    ]
    assert never_ran.payload.details["partial_results"] == []


async def test_a_failed_command_with_megabytes_of_output_still_ends_its_report_cut_to_the_budget(
    make_stack: StackFactory, event_log: EventLog
) -> None:
    await asyncio.to_thread(make_stack)
    floods = python_command(
        "import sys\nsys.stdout.write('x' * 2_000_000 + 'the last words')\nsys.exit(1)"
    )
    config = build_config("command", command=floods, return_budget=1000)

    agent = await GroveClient(event_log).spawn("flood", config)
    (ended,) = await wait_ends(event_log, agent, timeout=30)

    assert ended.reason == "failed"
    (failed,) = of(await events(event_log), agent, "status", "failed")
    (partial,) = failed.payload.details["partial_results"]
    assert len(partial) == 1000
    assert partial.endswith("x" * 100 + "the last words")
    assert failed.payload.details["truncated"] is True
    assert failed.payload.details["attempted"] == [shlex.join(floods)]

"""The `grove` command, run as a subprocess against a real nats-server and the services."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from grove_core.log import EventLog
from grove_core.natsserver import free_port
from grove_core.records import Recorded
from tests.conftest import NatsEndpoint, StackFactory

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

GROVE = [sys.executable, "-m", "agentgrove.cli"]


def grove_env(url: str | None) -> dict[str, str]:
    """The environment of a `grove` run: the URL given, no data folder or model endpoint
    inherited."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("GROVE_NATS_URL", "GROVE_DATA_DIR") and not k.startswith("OPENAI_")
    }
    if url is not None:
        env["GROVE_NATS_URL"] = url
    return env


def grove(
    url: str | None, *args: str, timeout: float = 30.0, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run `grove ARGS` to its end."""
    return subprocess.run(
        [*GROVE, *args],
        env=grove_env(url),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        check=False,
    )


def assert_one_line_error(result: subprocess.CompletedProcess[str], *expected: str) -> None:
    """A non-zero exit with exactly one `grove: error:` line on stderr, no traceback."""
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("grove: error: "), result.stderr
    assert "Traceback" not in result.stderr
    for text in expected:
        assert text in lines[0]


class Lines:
    """The stdout lines of a running process, read in the background."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.seen: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def until(self, found: Callable[[str], bool], timeout: float = 20.0) -> str:
        """The first line (from now on) for which `found` holds."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._queue.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                break
            self.seen.append(line)
            if found(line):
                return line
        raise AssertionError(f"no such line within {timeout}s; saw: {self.seen}")


@pytest.fixture
def popen() -> Iterator[Callable[..., subprocess.Popen[str]]]:
    """Start `grove` processes that are ended when the test ends; one started with
    `own_group=True` leads a process group of its own (as a terminal's foreground job does),
    which is ended whole."""
    procs: list[tuple[subprocess.Popen[str], bool]] = []

    def start(url: str | None, *args: str, own_group: bool = False) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [*GROVE, *args],
            env=grove_env(url),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=own_group,
        )
        procs.append((proc, own_group))
        return proc

    yield start
    for proc, own_group in procs:
        # What a process still running started (`grove up`'s services) goes with it.
        leftovers = child_processes(proc.pid) if proc.poll() is None else {}
        if own_group:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        for pid in leftovers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def child_processes(pid: int) -> dict[int, str]:
    """The running children of process `pid`: their pids and command names (from `ps`)."""
    listing = subprocess.run(
        ["ps", "-A", "-o", "pid=,ppid=,comm="], capture_output=True, text=True, check=True
    )
    children = {}
    for line in listing.stdout.splitlines():
        child, parent, command = line.split(None, 2)
        if int(parent) == pid:
            children[int(child)] = Path(command.strip()).name
    return children


def gone(pid: int) -> bool:
    """Whether no process `pid` exists any more."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def tree_json(url: str, *args: str) -> list[dict[str, Any]]:
    """`grove tree --json` parsed."""
    result = grove(url, "tree", "--json", *args)
    assert result.returncode == 0, result.stderr
    nodes: list[dict[str, Any]] = json.loads(result.stdout)
    return nodes


# -- spawn and stop ------------------------------------------------------------------------------


def test_spawn_wait_prints_the_result_of_a_command_agent(
    nats_server: NatsEndpoint, make_stack: StackFactory
) -> None:
    make_stack()
    result = grove(
        nats_server.url, "spawn", "one two three", "--command", "sh -c 'wc -w'", "--wait"
    )
    assert result.returncode == 0, result.stderr
    agent_id, *rest = result.stdout.splitlines()
    assert len(agent_id) == 36
    assert rest == ["reason: completed", "summary: 3"]


def test_spawn_wait_of_a_failing_command_exits_non_zero_with_the_error(
    nats_server: NatsEndpoint, make_stack: StackFactory
) -> None:
    make_stack()
    result = grove(
        nats_server.url, "spawn", "fail", "--wait", "--", "sh", "-c", "echo boom >&2; exit 3"
    )
    assert result.returncode == 1
    assert "reason: failed" in result.stdout
    assert "error: exit code 3: boom" in result.stdout


def test_stop_ends_a_long_running_agent_as_stopped(
    nats_server: NatsEndpoint,
    make_stack: StackFactory,
    popen: Callable[..., subprocess.Popen[str]],
) -> None:
    make_stack()
    waiting = popen(nats_server.url, "spawn", "sleep", "--command", "sleep 30", "--wait")
    lines = Lines(waiting)
    agent_id = lines.until(lambda line: len(line) == 36)

    stopped = grove(nats_server.url, "stop", agent_id, "--reason", "enough")

    assert stopped.returncode == 0, stopped.stderr
    assert f"stop requested for {agent_id}" in stopped.stdout
    assert lines.until(lambda line: line.startswith("reason:")) == "reason: stopped"
    assert waiting.wait(10) == 1
    assert tree_json(nats_server.url, "--agent", agent_id)[0]["state"] == "stopped"


def test_stop_of_an_unknown_agent_is_one_line_and_exit_1(
    nats_server: NatsEndpoint, event_log: EventLog
) -> None:
    result = grove(nats_server.url, "stop", "no-such-agent")
    assert result.returncode == 1
    assert_one_line_error(result, "no agent 'no-such-agent'")


@pytest.mark.parametrize(
    "args",
    [
        ("tree",),
        ("spawn", "x", "--command", "true", "--wait"),
        ("tail",),
    ],
)
def test_without_a_server_every_command_fails_fast_in_one_line(args: tuple[str, ...]) -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    started = time.monotonic()
    result = grove(url, *args, timeout=15)
    assert time.monotonic() - started < 8
    assert result.returncode == 1
    assert_one_line_error(result, f"cannot reach NATS at {url}")


def test_bad_flags_are_one_line(tmp_path: Path) -> None:
    for args in (("spawn", "x"), ("spawn", "x", "--entrypoint", "not an entrypoint")):
        assert_one_line_error(grove(f"nats://127.0.0.1:{free_port()}", *args))
    result = grove(None, "replay", "--from-time", "yesterday")
    assert result.returncode == 2
    assert_one_line_error(result, "--from-time")


# -- reading the log -----------------------------------------------------------------------------


def spawn_demo_tree(url: str) -> str:
    """Run the demo's root agent (three children) to its end; its id."""
    result = grove(url, "spawn", "demo", "--entrypoint", "tests.three_children:root", "--wait")
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.splitlines()[0]


def test_tree_shows_a_parent_with_its_children_and_replay_filters_by_agent(
    nats_server: NatsEndpoint, make_stack: StackFactory
) -> None:
    make_stack()
    root_id = spawn_demo_tree(nats_server.url)

    (root,) = tree_json(nats_server.url)

    assert root["agent_id"] == root_id
    assert root["state"] == "completed"
    assert [c["runtime"] for c in root["children"]] == ["python", "python", "command"]
    assert all(c["state"] == "completed" and c["parent"] == root_id for c in root["children"])
    assert "distinct words" in root["summary"]
    text = grove(nats_server.url, "tree").stdout.splitlines()
    assert text[0].startswith(f"{root_id}  [completed]")
    assert all(line.startswith("  ") and "[completed]" in line for line in text[1:])
    assert len(text) == 4
    assert_replay_filters_by_agent(nats_server.url, root_id, root["children"][0]["agent_id"])


def assert_replay_filters_by_agent(url: str, root_id: str, child_id: str) -> None:
    """`grove replay --agent` shows only that agent's events, in order, from spawn to end."""
    result = grove(url, "replay", "--agent", child_id, "--json")
    assert result.returncode == 0, result.stderr
    items = [json.loads(line) for line in result.stdout.splitlines()]
    assert {item["subject"].rsplit(".", 1)[1] for item in items} == {child_id}
    assert [item["event"]["type"] for item in (items[0], items[-1])] == ["spawn", "terminate"]
    assert [i["seq"] for i in items] == sorted(i["seq"] for i in items)
    human = grove(url, "replay", "--agent", child_id).stdout.splitlines()
    assert len(human) == len(items)
    assert all(child_id[-8:] in line for line in human)
    everything = grove(url, "replay").stdout
    assert root_id[-8:] in everything
    assert len(everything.splitlines()) > len(human)


def test_replay_from_a_time_leaves_out_what_came_before(
    nats_server: NatsEndpoint, event_log: EventLog
) -> None:
    early = grove(nats_server.url, "spawn", "early", "--command", "true")
    assert early.returncode == 0, early.stderr
    time.sleep(0.3)
    between = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    time.sleep(0.3)
    late = grove(nats_server.url, "spawn", "late", "--command", "true")
    assert late.returncode == 0, late.stderr

    since = grove(nats_server.url, "replay", "--from-time", between, "--json")
    readable = grove(nats_server.url, "replay", "--from-time", between)
    everything = grove(nats_server.url, "replay", "--json")

    assert since.returncode == 0, since.stderr
    assert [json.loads(line)["event"]["task"] for line in since.stdout.splitlines()] == ["late"]
    (line,) = readable.stdout.splitlines()
    assert "task='late'" in line
    tasks = [json.loads(line)["event"]["task"] for line in everything.stdout.splitlines()]
    assert tasks == ["early", "late"]


async def test_replay_shows_invalid_messages_as_such(
    nats_server: NatsEndpoint, event_log: EventLog
) -> None:
    await event_log.js.publish("grove.status.someone", b"not json")

    result = grove(nats_server.url, "replay")

    assert result.returncode == 0, result.stderr
    assert "INVALID" in result.stdout
    assert "grove.status.someone: body is not JSON" in result.stdout
    (line,) = grove(nats_server.url, "replay", "--json").stdout.splitlines()
    assert json.loads(line)["invalid"].startswith("body is not JSON")


def test_tail_prints_new_events_as_json_lines(
    nats_server: NatsEndpoint,
    event_log: EventLog,
    popen: Callable[..., subprocess.Popen[str]],
) -> None:
    grove(nats_server.url, "spawn", "before", "--command", "true")
    tail = popen(nats_server.url, "tail", "--json")
    lines = Lines(tail)
    time.sleep(1.0)  # the tail starts at the tip + 1
    agent_id = grove(nats_server.url, "spawn", "after", "--command", "true").stdout.strip()

    item = json.loads(lines.until(lambda text: '"type": "spawn"' in text))

    assert item["subject"] == f"grove.spawn.{agent_id}"
    assert item["event"]["task"] == "after"
    assert len(lines.seen) == 1
    tail.send_signal(signal.SIGINT)
    assert tail.wait(10) == 0


#: A human-readable line of the log: seq, UTC time, kind, short agent id, what it says.
LOG_LINE = re.compile(
    r"^ *(?P<seq>\d+)  (?P<time>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z)  "
    r"(?P<kind>[a-z]+) +(?P<agent>\S+) +(?P<says>.*)$"
)


def test_tail_prints_new_events_as_readable_lines(
    nats_server: NatsEndpoint,
    make_stack: StackFactory,
    popen: Callable[..., subprocess.Popen[str]],
) -> None:
    make_stack()
    before = grove(nats_server.url, "spawn", "before", "--command", "true", "--wait")
    assert before.returncode == 0, before.stderr
    tail = popen(nats_server.url, "tail")
    lines = Lines(tail)
    time.sleep(1.0)  # the tail starts at the tip + 1
    after = grove(nats_server.url, "spawn", "after", "--command", "echo hello there", "--wait")
    assert after.returncode == 0, after.stderr
    agent = after.stdout.splitlines()[0][-8:]

    lines.until(lambda line: "terminate" in line and agent in line)

    parsed = [LOG_LINE.match(line) for line in lines.seen]
    assert all(parsed), lines.seen
    rows = [m.groupdict() for m in parsed if m is not None]
    assert {row["agent"] for row in rows} == {agent}
    assert [int(row["seq"]) for row in rows] == sorted(int(row["seq"]) for row in rows)
    assert rows[0]["kind"] == "spawn"
    assert rows[0]["says"] == "command task='after'"
    assert {"status", "terminate"} <= {row["kind"] for row in rows}
    assert (rows[-1]["kind"], rows[-1]["says"]) == ("terminate", "completed: hello there")
    tail.send_signal(signal.SIGINT)
    assert tail.wait(10) == 0


# -- demo and up ---------------------------------------------------------------------------------


def test_demo_against_a_running_stack_prints_every_result(
    nats_server: NatsEndpoint, make_stack: StackFactory
) -> None:
    make_stack()

    result = grove(None, "demo", "--nats-url", nats_server.url, "--yes", timeout=90)

    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "-- tree at seq" in out
    assert "asks: The report is long." in out
    assert "answered automatically" in out
    results = out.split("results:", 1)[1].splitlines()
    assert sum(" completed: " in line for line in results) == 5
    assert any(" completed: tallied " in line for line in results)  # the command agent
    assert "Searched" in out
    assert "(truncated=True)" in out
    assert "as artifact" in out
    assert f"grove --nats-url {nats_server.url} replay --from-seq" in out


def test_demo_llm_without_a_key_says_what_it_needs(nats_server: NatsEndpoint) -> None:
    env_free = grove(None, "demo", "--nats-url", nats_server.url, "--llm")
    assert_one_line_error(env_free, "OPENAI_API_KEY")


def sigterm(up: subprocess.Popen[str]) -> None:
    """What a service manager does: SIGTERM to `grove up`."""
    up.send_signal(signal.SIGTERM)


def ctrl_c(up: subprocess.Popen[str]) -> None:
    """What Ctrl-C at a terminal does: SIGINT to the whole foreground process group."""
    os.killpg(up.pid, signal.SIGINT)


@pytest.mark.parametrize("stop", [sigterm, ctrl_c], ids=["sigterm", "ctrl-c"])
def test_up_runs_the_stack_until_stopped(
    stop: Callable[[subprocess.Popen[str]], None],
    tmp_path: Path,
    popen: Callable[..., subprocess.Popen[str]],
) -> None:
    data_dir = tmp_path / "up"
    port = free_port()
    up = popen(None, "up", "--data-dir", str(data_dir), "--port", str(port), own_group=True)
    lines = Lines(up)
    assert lines.until(lambda line: "NATS at" in line, 40).endswith(f"127.0.0.1:{port}")
    lines.until(lambda line: "grove: up" in line, 40)
    pids = [
        s["pid"] for s in json.loads((data_dir / "stack.json").read_text())["services"].values()
    ]
    (nats_pid,) = [pid for pid, name in child_processes(up.pid).items() if name == "nats-server"]
    # The server leads a process group of its own: a Ctrl-C reaches `grove up` and the
    # services, and `grove up` stops the server last, after the services.
    assert os.getpgid(nats_pid) != os.getpgid(up.pid)
    try:
        spawned = grove(
            None, "--data-dir", str(data_dir), "spawn", "a b", "--command", "wc -w", "--wait"
        )
        assert spawned.returncode == 0, spawned.stderr
        assert "summary: 2" in spawned.stdout

        stop(up)
        assert up.wait(30) == 0
        lines.until(lambda line: line == "grove: stopped", 5)
        assert all(gone(pid) for pid in [*pids, nats_pid])
        assert up.stderr is not None
        assert "Traceback" not in up.stderr.read()
        assert "Server Exiting" in (data_dir / "nats" / "nats-server.log").read_text()
        for log_file in (data_dir / "logs").iterdir():
            assert "Traceback" not in log_file.read_text(), log_file
        after = grove(None, "--nats-url", f"nats://127.0.0.1:{port}", "tree")
        assert_one_line_error(after, "cannot reach")
    finally:  # a failed test must not leave the server running
        with contextlib.suppress(ProcessLookupError):
            os.kill(nats_pid, signal.SIGKILL)


def test_up_with_a_nats_url_runs_the_services_on_that_server_and_leaves_it_running(
    nats_server: NatsEndpoint, tmp_path: Path, popen: Callable[..., subprocess.Popen[str]]
) -> None:
    data_dir = tmp_path / "up"
    up = popen(None, "up", "--nats-url", nats_server.url, "--data-dir", str(data_dir))
    lines = Lines(up)
    assert lines.until(lambda line: "NATS at" in line, 40) == f"grove: NATS at {nats_server.url}"
    lines.until(lambda line: "grove: up" in line, 40)
    assert not any("nats-server" in line for line in lines.seen), lines.seen
    assert "nats-server" not in child_processes(up.pid).values()
    assert not (data_dir / "nats").exists()
    services = json.loads((data_dir / "stack.json").read_text())["services"]
    assert set(services) == {"governor", "router", "artifacts", "spawner-1"}

    spawned = grove(nats_server.url, "spawn", "a b c", "--command", "wc -w", "--wait")
    assert spawned.returncode == 0, spawned.stderr
    assert "summary: 3" in spawned.stdout

    up.send_signal(signal.SIGINT)
    assert up.wait(30) == 0
    lines.until(lambda line: line == "grove: stopped", 5)
    assert all(gone(s["pid"]) for s in services.values())
    replayed = grove(nats_server.url, "replay", "--agent", spawned.stdout.splitlines()[0])
    assert replayed.returncode == 0, replayed.stderr
    assert "terminate" in replayed.stdout


# -- status, resume and fork ---------------------------------------------------------------------

REMEMBERS = "tests.lifecycle_agents:remembers"


async def ends(event_log: EventLog, agent_id: str, count: int, timeout: float = 20) -> list[Any]:
    """The agent's terminate events once there are `count` of them, oldest first."""
    found: list[Any] = []
    async with asyncio.timeout(timeout):
        async for item in event_log.events(1, subjects=f"grove.terminate.{agent_id}", follow=True):
            if isinstance(item, Recorded):
                found.append(item.event)
                if len(found) == count:
                    return found
    raise AssertionError("the log ended")


async def test_status_resume_and_fork_from_the_command_line(
    nats_server: NatsEndpoint, make_stack: StackFactory, event_log: EventLog
) -> None:
    await asyncio.to_thread(
        make_stack, config="resources:\n  global:\n    max_concurrent_agents: 5\n"
    )
    url = nats_server.url
    spawned = await asyncio.to_thread(grove, url, "spawn", "remember", "--entrypoint", REMEMBERS)
    assert spawned.returncode == 0, spawned.stderr
    agent = spawned.stdout.strip()
    await event_log.wait_for(f"grove.status.{agent}", timeout=20)

    early = await asyncio.to_thread(grove, url, "resume", agent)
    assert_one_line_error(early, f"agent {agent} has not ended")

    status = await asyncio.to_thread(grove, url, "status", "--agent", agent, "--json")
    assert status.returncode == 0, status.stderr
    answer = json.loads(status.stdout)
    assert answer["global"]["capacity"] == 5
    assert answer["self"]["agent_id"] == agent
    text = await asyncio.to_thread(grove, url, "status")
    assert "agents running: 1 of 5 (20%)" in text.stdout

    forked = await asyncio.to_thread(grove, url, "fork", agent, "--reason", "try the other way")
    assert forked.returncode == 0, forked.stderr
    fork_id = forked.stdout.strip()
    (fork_end,) = await ends(event_log, fork_id, 1)
    fork_result = json.loads(fork_end.result.summary)
    assert fork_end.reason == "completed"
    assert fork_result["fork_of"] == agent
    assert ["tool_result", "found a clue"] in fork_result["history"]

    counted = await asyncio.to_thread(
        grove,
        url,
        "fork",
        agent,
        "--reason",
        "count instead",
        "--task",
        "three little words",
        "--config",
        '{"runtime": "command", "command": ["wc", "-w"]}',
        "--subscribe",
        "topic:news",
    )
    assert counted.returncode == 0, counted.stderr
    counter = counted.stdout.strip()
    (count_end,) = await ends(event_log, counter, 1)
    assert (count_end.reason, count_end.result.summary.strip()) == ("completed", "3")
    fork_event = await event_log.get_last(f"grove.fork.{counter}")
    assert fork_event is not None
    assert json.loads(fork_event.data)["subscriptions"] == ["topic:news"]
    bad = await asyncio.to_thread(
        grove, url, "fork", agent, "--reason", "r", "--config", '{"runtime": "telepathy"}'
    )
    assert_one_line_error(bad, "invalid runtime")

    assert (await asyncio.to_thread(grove, url, "stop", agent)).returncode == 0
    await ends(event_log, agent, 1)
    resumed = await asyncio.to_thread(grove, url, "resume", agent, "--message", "go on")
    assert resumed.returncode == 0, resumed.stderr
    _, second = await ends(event_log, agent, 2)
    result = json.loads(second.result.summary)
    assert (second.reason, result["start"], result["message"]) == ("completed", "resume", "go on")
    assert ["user", "go on"] in result["history"]


def test_status_without_a_governor_says_so(nats_server: NatsEndpoint, event_log: EventLog) -> None:
    result = grove(nats_server.url, "status")
    assert_one_line_error(result, "the resource-governor did not answer")

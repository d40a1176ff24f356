"""The launcher forks service processes from a process that imported them already."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentgrove.launcher import Launcher, LauncherError

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


@pytest.fixture(scope="module")
def launcher() -> Iterator[Launcher]:
    with Launcher(["tests.launched"], env=ENV) as launcher:
        yield launcher


def fields(log: Path) -> dict[str, str]:
    return dict(re.findall(r"(\w+)=(\S*)", log.read_text()))


def test_a_child_runs_its_module_as_python_m_would(launcher: Launcher, tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    log.write_text("before\n")
    child = launcher.start(
        "tests.launched", {**ENV, "MARK": "given", "EXIT_CODE": "3"}, log, cwd=tmp_path
    )
    assert child.wait(10) == 3
    assert child.pid != launcher.pid
    seen = fields(log)
    assert log.read_text().startswith("before\n"), "the log is appended to"
    assert seen["name"] == "__main__"
    assert seen["argv"] == "[]"
    assert seen["cwd"] == str(tmp_path)
    assert seen["mark"] == "given"
    assert seen["pid"] == str(child.pid)


def test_children_make_ids_of_their_own(launcher: Launcher, tmp_path: Path) -> None:
    children = [launcher.start("tests.launched", ENV, tmp_path / f"{n}.log") for n in range(2)]
    assert [child.wait(10) for child in children] == [0, 0]
    first, second = (fields(tmp_path / f"{n}.log")["id"] for n in range(2))
    assert first[-12:] != second[-12:], "the random part of a UUIDv7"


def test_a_signal_ends_a_child_and_wait_gives_up_before(launcher: Launcher, tmp_path: Path) -> None:
    child = launcher.start("tests.launched", {**ENV, "BEHAVIOUR": "sleep"}, tmp_path / "c.log")
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(0.3)
    assert child.poll() is None
    child.send_signal(signal.SIGTERM)
    assert child.wait(10) == -signal.SIGTERM
    child.kill()  # after the exit: does nothing


def test_an_uncaught_exception_is_logged_and_exits_1(launcher: Launcher, tmp_path: Path) -> None:
    log = tmp_path / "c.log"
    child = launcher.start("tests.launched", {**ENV, "BEHAVIOUR": "raise"}, log)
    assert child.wait(10) == 1
    assert "RuntimeError: told to fail" in log.read_text()


def test_a_launcher_with_a_thread_running_refuses_to_start() -> None:
    with pytest.raises(LauncherError, match="may not fork with threads running"):
        Launcher(["tests.threaded"], env=ENV)


def test_a_closed_launcher_says_so(tmp_path: Path) -> None:
    launcher = Launcher(["tests.launched"], env=ENV)
    launcher.close()
    with pytest.raises(LauncherError, match="closed"):
        launcher.start("tests.launched", ENV, tmp_path / "c.log")


def test_a_log_that_cannot_be_opened_is_refused_and_starts_nothing(
    launcher: Launcher, tmp_path: Path
) -> None:
    with pytest.raises(LauncherError, match="cannot open the log"):
        launcher.start("tests.launched", ENV, tmp_path / "no-such-folder" / "c.log")
    child = launcher.start("tests.launched", ENV, tmp_path / "c.log")
    assert child.wait(10) == 0, "the launcher goes on"

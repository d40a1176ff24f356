"""The projection runner's writes: a write that fails loses no row."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self, cast

import pytest

from grove_core.log import EventLog
from grove_core.projection import Mark, ProjectionRunner, ProjectionStore
from grove_core.records import Recorded
from grove_core.rows import KeyedState

pytestmark = pytest.mark.unit


@dataclass
class Counters(KeyedState):
    values: dict[str, int] = field(default_factory=dict)

    def row(self, key: str) -> dict[str, Any] | None:
        return {"value": self.values[key]} if key in self.values else None

    @classmethod
    def from_rows(cls, rows: dict[str, dict[str, Any]]) -> Self:
        return cls(values={key: row["value"] for key, row in rows.items()})

    def set(self, key: str, value: int) -> None:
        self.values[key] = value
        self.touch(key)


class FailingOnce(ProjectionStore):
    """A store whose first write fails, as a locked or unreachable database would."""

    failed = False

    def save(
        self,
        projection: str,
        seq: int,
        changed: dict[str, dict[str, Any] | None],
        mark: Mark | None = None,
    ) -> None:
        if not self.failed:
            self.failed = True
            raise OSError("database is locked")
        super().save(projection, seq, changed, mark)


def unchanged(state: Counters, _: Recorded) -> Counters:
    return state


def runner_on(store: ProjectionStore) -> ProjectionRunner[Counters]:
    return ProjectionRunner(
        name="counters",
        log=cast(EventLog, None),  # writes never touch the log
        store=store,
        state_type=Counters,
        evolve=unchanged,
    )


def test_a_failed_write_keeps_its_rows_for_the_next(tmp_path: Path) -> None:
    store = FailingOnce(f"sqlite:///{tmp_path / 'p.db'}")
    runner = runner_on(store)
    runner.state.set("a", 1)
    runner.applied_seq = 1
    with pytest.raises(OSError, match="locked"):
        runner.flush()
    assert runner.flushed_seq == 0
    runner.state.set("b", 2)
    runner.applied_seq = 2
    runner.flush()
    assert store.load("counters") == (2, {"a": {"value": 1}, "b": {"value": 2}})
    assert runner.flushed_seq == 2


async def test_a_refused_write_marks_the_runner_unwritable_until_one_succeeds(
    tmp_path: Path,
) -> None:
    store = FailingOnce(f"sqlite:///{tmp_path / 'p.db'}")
    runner = runner_on(store)
    runner.state.set("a", 1)
    runner.applied_seq = 1
    assert await runner.write() is False
    assert not runner.writable
    assert runner.write_error == "OSError: database is locked"
    assert runner.flushed_seq == 0
    runner.state.set("b", 2)
    runner.applied_seq = 2
    assert await runner.write() is True
    assert runner.writable
    assert store.load("counters") == (2, {"a": {"value": 1}, "b": {"value": 2}})

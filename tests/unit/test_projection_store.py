"""The projection store writes rows and checkpoint together and reads them back."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from grove_core.projection import Origin, ProjectionStore
from grove_core.rows import encode_row, plain
from grove_router.domain import RouterState
from grove_router.domain import evolve as evolve_router
from tests.unit.helpers import Log

pytestmark = pytest.mark.unit


def test_rows_and_checkpoint_round_trip(tmp_path: Path) -> None:
    store = ProjectionStore(f"sqlite:///{tmp_path / 'p.db'}")
    assert store.load("gov") == (0, {})
    store.save("gov", 5, {"a": {"x": 1}, "b": {"x": 2}})
    store.save("gov", 7, {"a": None, "b": {"x": 3}})
    store.save("other", 1, {"a": {"y": 1}})
    assert store.load("gov") == (7, {"b": {"x": 3}})
    store.save("gov", 9, {"c": encode_row({"x": [4]}), "b": None})  # rows as JSON text
    assert store.load("gov") == (9, {"c": {"x": [4]}})
    assert store.load("other") == (1, {"a": {"y": 1}})
    store.close()


def test_an_origin_is_recorded_and_a_discard_empties_only_its_projection(tmp_path: Path) -> None:
    store = ProjectionStore(f"sqlite:///{tmp_path / 'p.db'}")
    first, second = Origin(log="GROVE made 1", fold="1"), Origin(log="GROVE made 2", fold="1")
    assert store.origin("gov") is None
    store.set_origin("gov", first, discard=False)
    store.save("gov", 5, {"a": {"x": 1}})
    store.save("other", 3, {"a": {"y": 1}})
    assert store.origin("gov") == first
    store.set_origin("gov", second, discard=True)
    assert store.origin("gov") == second
    assert store.load("gov") == (0, {})
    assert store.load("other") == (3, {"a": {"y": 1}})
    store.close()


def test_a_row_is_what_asdict_gives_and_does_not_change_with_the_state() -> None:
    """Both forms of a row (plain data, JSON text) are the record's fields as asdict gives
    them, and neither changes when the fold changes the record afterwards."""
    log = Log()
    log.spawn("root")
    log.spawn("kid", parent="root", subscriptions=["topic:x"])
    log.status("root", "started")
    log.terminate("kid")
    state = RouterState()
    for recorded in log.records:
        state = evolve_router(state, recorded)
    records: list[object] = [*state.routes.values(), *state.tree.agents.values()]
    records += [entry for entries in state.inboxes.values() for entry in entries]
    assert records
    for record in records:
        fields = json.loads(json.dumps(dataclasses.asdict(record)))  # type: ignore[call-overload]
        assert plain(record) == json.loads(encode_row(record)) == fields
    route = state.routes["kid"]
    row, text = plain(route), encode_row(route)
    route.subscriptions.append("topic:later")
    assert "topic:later" not in row["subscriptions"]
    assert "topic:later" not in text
    with pytest.raises(TypeError):
        plain({1, 2})
    with pytest.raises(TypeError):
        encode_row({1, 2})

"""The projection store writes rows and checkpoint together and reads them back."""

from __future__ import annotations

from pathlib import Path

import pytest

from grove_core.projection import ProjectionStore

pytestmark = pytest.mark.unit


def test_rows_and_checkpoint_round_trip(tmp_path: Path) -> None:
    store = ProjectionStore(f"sqlite:///{tmp_path / 'p.db'}")
    assert store.load("gov") == (0, {})
    store.save("gov", 5, {"a": {"x": 1}, "b": {"x": 2}})
    store.save("gov", 7, {"a": None, "b": {"x": 3}})
    store.save("other", 1, {"a": {"y": 1}})
    assert store.load("gov") == (7, {"b": {"x": 3}})
    assert store.load("other") == (1, {"a": {"y": 1}})
    store.close()

"""The spawner's, the tree's and the artifact index's folds."""

from __future__ import annotations

import pytest

from grove_artifacts.domain import ArtifactIndex
from grove_artifacts.domain import evolve as evolve_artifacts
from grove_core.tree import TreeState
from grove_core.tree import evolve as evolve_tree
from grove_spawner.domain import SpawnerState
from grove_spawner.domain import evolve as evolve_spawner
from tests.unit.helpers import Log

pytestmark = pytest.mark.unit


def test_spawner_tracks_what_each_replica_started_until_it_ends() -> None:
    log = Log()
    log.spawn("a")
    log.status("a", "admitted")
    log.status("a", "started", spawner_id="s1", runtime="command")
    log.spawn("b")
    log.status("b", "started", spawner_id="s2", runtime="python")
    state = SpawnerState()
    for recorded in log.records:
        state = evolve_spawner(state, recorded)
    assert [a.agent_id for a in state.started_by("s1")] == ["a"]
    state = evolve_spawner(state, log.terminate("a"))
    assert state.started_by("s1") == []
    assert [a.agent_id for a in state.started_by("s2")] == ["b"]


def test_tree_follows_the_lifecycle_and_nesting() -> None:
    log = Log()
    log.spawn("root")
    log.spawn("kid", parent="root")
    log.spawn("grandkid", parent="kid")
    log.status("root", "admitted")
    log.status("root", "started")
    log.status("root", "checkpoint", "halfway")
    log.terminate("grandkid", "failed", error="boom")
    state = TreeState()
    for recorded in log.records:
        state = evolve_tree(state, recorded)
    root = state.agents["root"]
    assert root.state == "running"
    assert root.summary == "halfway"
    assert root.children == ["kid"]
    assert state.agents["grandkid"].tree_id == "root"
    assert state.agents["grandkid"].state == "failed"
    assert state.agents["grandkid"].error == "boom"
    assert state.path("grandkid") == ["root", "kid", "grandkid"]
    assert [n.agent_id for n in state.subtree("kid")] == ["kid", "grandkid"]
    assert [n.agent_id for n in state.roots()] == ["root"]


def test_a_status_after_the_end_does_not_revive_an_agent() -> None:
    log = Log()
    log.spawn("a")
    log.terminate("a", "stopped")
    log.status("a", "started")
    state = TreeState()
    for recorded in log.records:
        state = evolve_tree(state, recorded)
    assert state.agents["a"].state == "stopped"


def test_artifact_index_counts_each_artifact_once() -> None:
    log = Log()
    log.artifact("a", "art-1", size=5)
    log.artifact("a", "art-1", size=5)
    log.artifact("a", "art-2", size=7)
    state = ArtifactIndex()
    for recorded in log.records:
        state = evolve_artifacts(state, recorded)
    assert set(state.artifacts) == {"art-1", "art-2"}
    assert state.total_bytes == 12


def test_tree_rows_round_trip() -> None:
    log = Log()
    log.spawn("root")
    log.spawn("kid", parent="root")
    state = TreeState()
    for recorded in log.records:
        state = evolve_tree(state, recorded)
    rows = {k: v for k, v in state.take_dirty().items() if v is not None}
    again = TreeState.from_rows(rows)
    assert again.agents == state.agents


def test_a_fork_joins_its_source_s_parent_and_tree() -> None:
    log = Log()
    log.spawn("root")
    log.spawn("kid", parent="root")
    log.fork("kid-fork", source="kid")
    log.fork("orphan-fork", source="nobody")
    state = TreeState()
    for recorded in log.records:
        state = evolve_tree(state, recorded)
    fork = state.agents["kid-fork"]
    assert fork.parent == "root"
    assert fork.tree_id == "root"
    assert fork.fork_of == "kid"
    assert fork.task == "task of kid"
    assert state.agents["root"].children == ["kid", "kid-fork"]
    assert "orphan-fork" not in state.agents

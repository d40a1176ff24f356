"""The artifact index as a story: given these events, then this index."""

from __future__ import annotations

from typing import Any

import pytest

from grove_artifacts.domain import ArtifactIndex, evolve
from grove_events import ArtifactEvent, new_id
from tests.unit.helpers import T0, Log

pytestmark = pytest.mark.unit

SHA_A = "a" * 64
SHA_B = "b" * 64


def artifact(
    log: Log, action: str, agent_id: str, artifact_id: str, sha256: str, size: int, **kw: Any
) -> None:
    log.add(
        ArtifactEvent(
            event_id=new_id(),
            agent_id=agent_id,
            timestamp=T0,
            action=action,  # type: ignore[arg-type]
            artifact_id=artifact_id,
            name=f"{artifact_id}.txt",
            size=size,
            sha256=sha256,
            **kw,
        )
    )


def fold(log: Log) -> ArtifactIndex:
    state = ArtifactIndex()
    for recorded in log.records:
        state = evolve(state, recorded)
    return state


def story() -> Log:
    """Two trees; the first shares a blob between two artifacts, then deletes one of them."""
    log = Log()
    log.spawn("root")
    log.spawn("kid", parent="root")
    log.fork("kid-fork", source="kid")
    log.spawn("other")
    log.spawn("forged", parent="kid", tree_id="other")
    artifact(log, "put", "kid", "art-1", SHA_A, 100, tree_id="root")
    artifact(log, "put", "kid-fork", "art-2", SHA_A, 100)
    artifact(log, "put", "other", "art-3", SHA_B, 7)
    artifact(log, "put", "other", "art-3", SHA_B, 7)
    artifact(log, "delete", "root", "art-1", SHA_A, 100)
    return log


def test_agents_are_placed_in_their_tree_whatever_they_claim() -> None:
    state = fold(story())
    assert state.agents == {
        "root": "root",
        "kid": "root",
        "kid-fork": "root",
        "other": "other",
        "forged": "root",
    }
    assert state.tree_of("nobody") is None


def test_totals_count_live_artifacts_and_blob_references() -> None:
    state = fold(story())
    assert [a.artifact_id for a in state.live()] == ["art-2", "art-3"]
    assert [a.artifact_id for a in state.live("root")] == ["art-2"]
    assert state.artifacts["art-2"].tree_id == "root", "a put without tree_id: its agent's tree"
    assert dict(state.tree_bytes) == {"root": 100, "other": 7}
    assert dict(state.tree_counts) == {"root": 1, "other": 1}
    assert dict(state.blob_refs) == {SHA_A: 1, SHA_B: 1}
    assert (state.total_bytes, state.total_count, state.blob_bytes) == (107, 2, 107)
    deleted = state.artifacts["art-1"]
    assert (deleted.deleted, deleted.deleted_by) == (True, "root")


def test_deleting_the_last_user_of_a_blob_frees_it_and_a_second_delete_changes_nothing() -> None:
    log = story()
    artifact(log, "delete", "kid", "art-2", SHA_A, 100)
    artifact(log, "delete", "kid", "art-2", SHA_A, 100)
    state = fold(log)
    assert SHA_A not in state.blob_refs
    assert SHA_A not in state.blob_sizes
    assert "root" not in state.tree_bytes
    assert state.total_bytes == 7
    assert state.artifacts["art-2"].deleted_by == "kid"


def test_the_stored_rows_rebuild_the_same_index() -> None:
    state = fold(story())
    rows = {key: row for key, row in state.take_dirty().items() if row is not None}
    again = ArtifactIndex.from_rows(rows)
    assert again.artifacts == state.artifacts
    assert again.agents == state.agents
    assert again.tree_bytes == state.tree_bytes
    assert again.blob_refs == state.blob_refs
    assert again.blob_sizes == state.blob_sizes


def test_rows_of_an_index_without_the_newer_fields_still_load() -> None:
    old_row = {
        "artifact_id": "art-9",
        "tree_id": "root",
        "agent_id": "kid",
        "name": "x",
        "media_type": "text/plain",
        "size": 3,
        "sha256": SHA_B,
    }
    state = ArtifactIndex.from_rows({"art-9": old_row})
    assert state.tree_bytes["root"] == 3
    assert not state.artifacts["art-9"].deleted

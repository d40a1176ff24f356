"""A fold that names the kinds it reads ignores every other kind: its service may pass them
over undecoded (`ProjectionRunner(kinds=)`) and end with the same state."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from grove_artifacts import domain as artifacts
from grove_core.records import Recorded
from grove_events import HitlEvent, MessageEvent, new_id
from grove_governor import domain as governor
from grove_spawner import domain as spawner
from tests.unit.helpers import T0, Log

pytestmark = pytest.mark.unit

FOLDS: dict[str, tuple[Callable[[], Any], Callable[[Any, Recorded], Any], frozenset[str]]] = {
    "governor": (governor.GovernorState, governor.evolve, governor.FOLDED_KINDS),
    "spawner": (spawner.SpawnerState, spawner.evolve, spawner.FOLDED_KINDS),
    "artifacts": (artifacts.ArtifactIndex, artifacts.evolve, artifacts.FOLDED_KINDS),
}


def busy_log() -> Log:
    """A tree with every kind of event: lifecycles, a fork, controls, messages, questions,
    artifacts."""
    log = Log()
    log.spawn("root")
    log.status("root", "admitted")
    log.status("root", "started", spawner_id="s-1", runtime="command")
    log.spawn("kid", parent="root")
    log.add(
        MessageEvent(
            event_id=new_id(), agent_id="root", from_="root", to="kid", content="hi", timestamp=T0
        )
    )
    log.status("kid", "admitted")
    log.status("kid", "started", spawner_id="s-1", runtime="command")
    log.add(
        HitlEvent(
            event_id=new_id(),
            agent_id="kid",
            action="request",
            request_id="q-1",
            prompt="may I?",
            timestamp=T0,
        )
    )
    log.artifact("kid", "art-1", size=40)
    log.fork("kid-fork", source="kid")
    log.control("kid", "stop", reason="enough")
    log.terminate("kid", "stopped")
    log.status("root", "completed")
    log.terminate("root")
    return log


@pytest.mark.parametrize("service", sorted(FOLDS))
def test_the_kinds_a_fold_does_not_name_change_nothing(service: str) -> None:
    state_type, evolve, kinds = FOLDS[service]
    records = busy_log().records
    assert {r.event.type for r in records} - kinds, "the log must have kinds the fold skips"
    everything, only_named = state_type(), state_type()
    for recorded in records:
        everything = evolve(everything, recorded)
        if recorded.event.type in kinds:
            only_named = evolve(only_named, recorded)
    assert everything.take_dirty() == only_named.take_dirty()
    assert everything == only_named

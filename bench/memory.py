"""Memory and fold time of the governor's and the tree's state, measured in this process.

Memory is what the state keeps after folding, by tracemalloc (Python heap allocations: the
objects the fold created and the state still references), divided by the agents tracked.
"""

from __future__ import annotations

import gc
import time
import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any

from bench.loggen import Lifecycles
from grove_core.records import RawRecord, decode_record
from grove_core.tree import TreeState
from grove_core.tree import evolve as tree_evolve
from grove_events import ResourceLimits
from grove_governor.domain import GovernorState, decide
from grove_governor.domain import evolve as governor_evolve

FOLDS: dict[str, tuple[Callable[[], Any], Callable[[Any, Any], Any]]] = {
    "governor": (GovernorState, governor_evolve),
    "router": (TreeState, tree_evolve),
}


def _fold(name: str, records: Iterator[RawRecord]) -> tuple[Any, int, float]:
    make, evolve = FOLDS[name]
    state = make()
    count = 0
    started = time.perf_counter()
    for raw in records:
        state = evolve(state, decode_record(raw))
        count += 1
    return state, count, time.perf_counter() - started


def tracked(agents: int, family: int) -> dict[str, Any]:
    """Fold `agents` running agents (spawn, admitted, started) in families of `family` (one
    parent and its children) into each state: fold rate, and bytes kept per agent."""
    out: dict[str, Any] = {"agents": agents, "family": family}
    lifecycles = Lifecycles(running_only=True, family=family)
    for name in FOLDS:
        # Timing without tracemalloc, which slows every allocation down.
        state, events, seconds = _fold(name, lifecycles.records(agents))
        entry: dict[str, Any] = {
            "fold_events_per_s": round(events / seconds, 1),
        }
        if isinstance(state, GovernorState):
            state.dirty.clear()
            # A round of decisions on the clock (runtime limits of every running agent checked)
            # and one after an event (only agents waiting for a decision).
            started = time.perf_counter()
            decide(state, ResourceLimits(), time.time(), {})
            entry["decide_ms"] = round((time.perf_counter() - started) * 1000, 3)
            started = time.perf_counter()
            decide(state, ResourceLimits(), time.time(), {}, check_limits=False)
            entry["decide_on_event_ms"] = round((time.perf_counter() - started) * 1000, 3)
        del state
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        state, _, _ = _fold(name, lifecycles.records(agents))
        state.dirty.clear()
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        entry["bytes_per_agent"] = round((after - before) / agents, 1)
        entry["total_mib"] = round((after - before) / 2**20, 2)
        out[name] = entry
        del state
        gc.collect()
    return out

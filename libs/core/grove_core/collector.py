"""Keeping long-lived objects out of the cyclic garbage collector's way.

A service keeps two large sets of objects for as long as it runs: what it loaded while
starting (modules, schemas, clients: hundreds of thousands of objects) and the state its
projection folded from the log. CPython's full collections walk every tracked object each
time; with both sets in the heap, each one walked them all again. Measured: in the spawner,
which imports its runtimes' SDKs, a full collection took about 80 ms and came several times a
minute in a burst of agents; with 100,000 agents in the governor's and the tree's state, one
took 166 ms, a stall of the service's event loop each time.

`gc.freeze` moves every object tracked at that moment to a generation the collector leaves
alone. Frozen objects are still freed by their reference counts; only a reference cycle among
them that becomes garbage is kept (the services' states refer to each other by ids, not
objects, so they make no cycles).

A service's process also collects its youngest generation less often: after 10,000 more
allocations than frees of tracked objects (`LIVE_THRESHOLD`), not Python's 700. Most of what a
service allocates for an event (the decoded event, records, futures, tasks) is freed by its
reference count soon after; at 700, a collection came every few agents of a burst, found
hundreds of agents' objects still in flight, and moved them to the older generations, which
then walked them again. Measured in the spawner over three bursts of 5,000 agents: 13 % of its
CPU in collections (1,835 of the youngest, 166 of the middle, 16 full), against 5 % (64, 5, 1)
at 10,000. A collection of the youngest generation walks only what is still alive in it, so
when the service is quiet each one stays short.
"""

from __future__ import annotations

import gc

#: The collector's first threshold in a service's process (Python's default: 700).
LIVE_THRESHOLD = 10_000

#: Whether this process is a service's own (`manage`): only then is its heap frozen. A
#: process that embeds a projection runner among its own objects (a test run, a tool) keeps
#: the collector as it was.
_managed = False


def manage() -> None:
    """Collect less often (`LIVE_THRESHOLD`) and freeze the heap at the moments below, for the
    rest of this process (a service's entry point calls it)."""
    global _managed  # noqa: PLW0603 - one switch for the whole process
    _managed = True
    _, *older = gc.get_threshold()
    gc.set_threshold(LIVE_THRESHOLD, *older)


def started() -> None:
    """Once a service has started: collect what starting left behind, freeze the rest."""
    if _managed:
        gc.collect()
        gc.freeze()


def caught_up() -> None:
    """Once a projection has folded the log that was there when it started: freeze its state
    (after a collection of the youngest generation only, which is quick)."""
    if _managed:
        gc.collect(0)
        gc.freeze()

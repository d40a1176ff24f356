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
"""

from __future__ import annotations

import gc

#: Whether this process is a service's own (`manage`): only then is its heap frozen. A
#: process that embeds a projection runner among its own objects (a test run, a tool) keeps
#: the collector as it was.
_managed = False


def manage() -> None:
    """Freeze the heap at the moments below, for the rest of this process (a service's entry
    point calls it)."""
    global _managed  # noqa: PLW0603 - one switch for the whole process
    _managed = True


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

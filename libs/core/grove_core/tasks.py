"""Ending tasks for sure.

On Python 3.11, `asyncio.wait_for` returns the awaited result instead of raising when the
cancellation of its task arrives in the same turn of the loop as that result (fixed in 3.12).
nats-py waits for every request's reply that way, so a task cancelled just as a reply comes in
can go on as if nothing happened: a service stopping would wait on it for ever.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any


async def cancel_and_wait(task: asyncio.Task[Any], *, again_after: float = 1.0) -> None:
    """Cancel `task` and wait until it has ended, cancelling it again every `again_after`
    seconds while it goes on (a cancellation it lost). What it returned or raised is dropped."""
    while not task.done():
        task.cancel()
        await asyncio.wait([task], timeout=again_after)
    if not task.cancelled():
        with contextlib.suppress(BaseException):
            task.result()  # retrieved: never reported as an exception nobody looked at

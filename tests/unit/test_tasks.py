"""Ending a task that loses a cancellation (`grove_core.tasks.cancel_and_wait`)."""

from __future__ import annotations

import asyncio

from grove_core.tasks import cancel_and_wait


async def test_a_task_that_loses_its_first_cancellation_is_ended_all_the_same() -> None:
    cancellations = 0

    async def goes_on_once() -> None:
        nonlocal cancellations
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancellations += 1
                if cancellations > 1:
                    raise
                # As a wait_for of Python 3.11 does when its result comes with the cancellation.

    task = asyncio.create_task(goes_on_once())
    await asyncio.sleep(0)
    async with asyncio.timeout(5):
        await cancel_and_wait(task, again_after=0.05)
    assert task.cancelled()
    assert cancellations == 2


async def test_a_task_ended_with_an_error_is_waited_for_and_its_error_dropped() -> None:
    async def fails_when_cancelled() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            raise RuntimeError("failed on the way out") from None

    task = asyncio.create_task(fails_when_cancelled())
    await asyncio.sleep(0)
    await cancel_and_wait(task)
    assert isinstance(task.exception(), RuntimeError)


async def test_a_finished_task_is_left_as_it_is() -> None:
    task = asyncio.create_task(asyncio.sleep(0, result="done"))
    await task
    await cancel_and_wait(task)
    assert task.result() == "done"

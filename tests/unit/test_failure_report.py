"""What of a failure's `attempted` and `partial_results` the `failed` status keeps: the newest,
within the agent's return budget."""

from __future__ import annotations

import pytest

from grove_spawner.service import newest_within_budget

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("entries", "budget", "kept", "cut"),
    [
        ([], 10, [], False),
        (["tried the door"], 100, ["tried the door"], False),
        (["ab", "cd", "ef"], 6, ["ab", "cd", "ef"], False),
        (["ab", "cd", "ef"], 3, ["d", "ef"], True),
        (["ab", "cd", "ef"], 2, ["ef"], True),
        (["x" * 50 + "the end"], 7, ["the end"], True),
    ],
)
def test_the_newest_entries_within_the_budget_are_kept(
    entries: list[str], budget: int, kept: list[str], cut: bool
) -> None:
    assert newest_within_budget(entries, budget) == (kept, cut)

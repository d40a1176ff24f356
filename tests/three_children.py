"""A small tree the CLI tests run: `tests.three_children:root`.

A root `python` agent hands two short texts to three children: two `python` agents (a word
count and a summary) and one `command` agent (a Python one-liner counting distinct words, the
task on its stdin). Each child reports a checkpoint and returns a result; the root waits for the
three and returns their combined result.
"""

from __future__ import annotations

import asyncio
import re
import sys
from collections import Counter

from agentgrove.context import AgentContext
from agentgrove.results import AgentResult

TEXTS = (
    "A grove is a small group of trees. In AgentGrove every agent is a tree node: it may "
    "spawn children, wait for them, and report what they found. The log remembers every "
    "fact, so the whole tree can be replayed later.",
    "Events are facts written once. Services fold them into state and can always rebuild it. "
    "A person debugging a run reads the same log. Nothing is lost when a process dies.",
)

#: How long the root waits for each child.
CHILD_TIMEOUT_S = 30.0
#: A short pause in each child, so that the running states can be seen in the tree.
WORK_PAUSE_S = 0.5

_WORD = re.compile(r"[A-Za-z']+")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_DISTINCT_WORDS = (
    "import re, sys; text = sys.stdin.read().partition(':')[2]; "
    'words = {w.lower() for w in re.findall(r"[A-Za-z\']+", text)}; '
    "print(len(words), 'distinct words')"
)


def text_of(task: str) -> str:
    """The text a child works on: what follows the first colon of its task."""
    return task.partition(":")[2].strip()


async def count_words(ctx: AgentContext) -> str:
    """Count the words of the text in the task, and name the most common long ones."""
    words = _WORD.findall(text_of(ctx.task))
    await ctx.checkpoint(f"read {len(words)} words")
    await asyncio.sleep(WORK_PAUSE_S)
    common = Counter(w.lower() for w in words if len(w) > 3).most_common(3)
    return f"{len(words)} words; most common: " + ", ".join(w for w, _ in common)


async def summarize(ctx: AgentContext) -> str:
    """Summarize the text in the task as its sentence count and its first sentence."""
    sentences = [s for s in _SENTENCE_END.split(text_of(ctx.task)) if s]
    await ctx.checkpoint(f"split into {len(sentences)} sentences")
    await asyncio.sleep(WORK_PAUSE_S)
    first = sentences[0] if sentences else ""
    return f"{len(sentences)} sentences, starting: {first}"


def distinct_words_command() -> list[str]:
    """The argv of the command agent: this Python counting distinct words on its stdin."""
    return [sys.executable, "-c", _DISTINCT_WORDS]


def _combine(names: list[str], results: list[AgentResult]) -> str:
    failed = [
        f"{name} {r.reason} ({r.error})" for name, r in zip(names, results, strict=True) if not r.ok
    ]
    if failed:
        raise RuntimeError("children did not complete: " + "; ".join(failed))
    return "; ".join(f"{name}: {r.summary.strip()}" for name, r in zip(names, results, strict=True))


async def root(ctx: AgentContext) -> str:
    """Spawn the three children, wait for them, and return their combined result."""
    await ctx.checkpoint("spawning three children")
    children = {
        "word count": await ctx.spawn_agent(
            f"Count the words: {TEXTS[0]}", entrypoint="tests.three_children:count_words"
        ),
        "summary": await ctx.spawn_agent(
            f"Summarize: {TEXTS[1]}", entrypoint="tests.three_children:summarize"
        ),
        "distinct words": await ctx.spawn_agent(
            f"Count the distinct words: {TEXTS[0]} {TEXTS[1]}",
            runtime="command",
            command=distinct_words_command(),
        ),
    }
    await ctx.checkpoint(f"waiting for {len(children)} children")
    results = await asyncio.gather(
        *(ctx.wait(child, CHILD_TIMEOUT_S) for child in children.values())
    )
    return _combine(list(children), list(results))

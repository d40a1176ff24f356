"""The demonstration tree that `grove demo` runs, offline and without an API key.

A root `python` agent delegates with the `task` tool to two built-in `explore` subagents that
search AgentGrove's own documentation (one about replaying the log, one about metrics), at the
same time. It then hands their findings to two children at once: a `writer` (python), which
asks a person through the human-in-the-loop path how detailed its report should be and writes a
report longer than its return budget, so the parent receives the summary cut to the budget and
the handle of the full report, which it reads from the artifact-store; and a `command` agent, a
small program that reads the findings on stdin and tallies the passages per document. The root
returns what it learned.

With `grove demo --llm` the root runs on the `openai` runtime instead, with the same tools.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
from pathlib import Path

from agentgrove.context import AgentContext
from agentgrove.profiles import SubAgentResult

ROOT_ENTRYPOINT = "agentgrove.demo:root"
ROOT_TASK = (
    "Find out what AgentGrove's own documentation says about replaying the log and about its "
    "metrics, with explore subagents, and have a writer turn the findings into a report"
)
#: The prompt of the root when it runs on the `openai` runtime (`grove demo --llm`).
LLM_ROOT_TASK = (
    "You manage a small team of subagents. Use the `task` tool twice, with subagent_type "
    "'explore', to search the documentation folder named below: once for how the event log is "
    "replayed, exported and imported, once for the Prometheus metrics. Then answer with three "
    "sentences on what AgentGrove offers for debugging a run.\n"
)
WRITER_ENTRYPOINT = "agentgrove.demo:writer"
#: The writer's return budget: its report is longer, so it comes back as summary + artifact.
WRITER_BUDGET = 600
#: How long the root waits for the writer (it waits for a person's answer, too).
WRITER_TIMEOUT_S = 600.0
QUESTION = "The report is long. Include every finding with its file and line?"
OPTIONS = ["yes", "no (the first five of each)"]
#: The command agent's program: any CLI would do; this one is Python's standard library only.
#: It reads the findings (JSON, `{topic: ["path:line: text", ...]}`) on stdin and prints one
#: line: how many passages each document gave.
TALLY_SCRIPT = """\
import collections, json, sys
found = json.load(sys.stdin)
per_document = collections.Counter(
    passage.split(":", 1)[0] for passages in found.values() for passage in passages
)
ranked = ", ".join(f"{name} ({count})" for name, count in sorted(per_document.items()))
total = sum(per_document.values())
print(f"tallied {total} passages from {len(per_document)} documents: {ranked or 'none'}")
"""
#: How long the root waits for the command agent.
TALLY_TIMEOUT_S = 60.0

_WORKSPACE_LINE = re.compile(r"(?im)^\s*workspace:\s*(\S+)\s*$")


def documentation_folder() -> Path:
    """AgentGrove's own docs folder (beside the README of a checkout), else the current one."""
    for parent in Path(__file__).resolve().parents:
        if (parent / "docs").is_dir() and (parent / "README.md").is_file():
            return parent / "docs"
    return Path.cwd()


def root_task(workspace: Path) -> str:
    """The root's task: what to do, and where the documentation is."""
    return f"{ROOT_TASK}\nworkspace: {workspace}"


def workspace_in(task: str) -> Path:
    """The `workspace: PATH` line of a task (default: the documentation folder)."""
    found = _WORKSPACE_LINE.search(task)
    return Path(found.group(1)) if found else documentation_folder()


def tally_command() -> list[str]:
    """The command agent's argv: this Python, isolated from the environment, on TALLY_SCRIPT."""
    return [sys.executable, "-I", "-c", TALLY_SCRIPT]


def findings_of(result: SubAgentResult) -> list[str]:
    """The finding lines of an explore report (`- path:line: text`)."""
    return [line[2:] for line in result.content.splitlines() if line.startswith("- ")]


async def root(ctx: AgentContext) -> str:
    """Delegate to two explorers at once; have the writer report and a command agent tally
    the findings, at once; read the full report."""
    workspace = workspace_in(ctx.task)
    await ctx.checkpoint(f"delegating to two explore subagents in {workspace}")
    replay, metrics = await asyncio.gather(
        ctx.delegate(
            "replaying the event log",
            f"workspace: {workspace}\nreplay export import incident",
            "explore",
        ),
        ctx.delegate(
            "metrics and the dashboard",
            f"workspace: {workspace}\nmetrics prometheus grafana dashboard",
            "explore",
        ),
    )
    found = {"replay": findings_of(replay), "metrics": findings_of(metrics)}
    await ctx.checkpoint(
        f"explorers found {len(found['replay'])} and {len(found['metrics'])} passages; "
        "handing them to the writer and to a command agent that tallies them"
    )
    writer = await ctx.spawn_agent(
        json.dumps(found), entrypoint=WRITER_ENTRYPOINT, return_budget=WRITER_BUDGET
    )
    tally = await ctx.spawn_agent(json.dumps(found), runtime="command", command=tally_command())
    report, counted = await asyncio.gather(
        ctx.wait(writer, timeout=WRITER_TIMEOUT_S), ctx.wait(tally, timeout=TALLY_TIMEOUT_S)
    )
    if not counted.ok:
        raise RuntimeError(f"the command agent {counted.reason}: {counted.error}")
    if not report.ok:
        raise RuntimeError(f"the writer {report.reason}: {report.error}")
    tallied = counted.summary.strip().split(":", 1)[0]  # "tallied N passages from M documents"
    if report.artifact is None:
        return f"{tallied}; report ({len(report.summary)} characters): {report.summary}"
    full = (await ctx.get_artifact(report.artifact)).decode()
    await ctx.discovery(f"the full report is artifact {report.artifact}")
    return (
        f"explore found {len(found['replay'])} passages on replay and "
        f"{len(found['metrics'])} on metrics; the writer's report came back as "
        f"{len(report.summary)} characters of summary (truncated={report.truncated}) and the "
        f"full {len(full)} characters as artifact {report.artifact}; the command agent "
        f"{tallied}"
    )


async def writer(ctx: AgentContext) -> str:
    """Ask a person how detailed to be, then write the report from the findings."""
    found: dict[str, list[str]] = json.loads(ctx.task)
    await ctx.blocked("waiting for a person: how detailed should the report be?")
    answer = await ctx.ask_human(QUESTION, options=OPTIONS)
    everything = answer.strip().lower().startswith("y")
    await ctx.checkpoint(f"writing the report ({'every finding' if everything else 'a digest'})")
    lines = ["# What AgentGrove's documentation says", ""]
    for topic, passages in found.items():
        chosen = passages if everything else passages[:5]
        lines += [f"## {topic} ({len(chosen)} of {len(passages)} passages)", ""]
        lines += [f"- {passage}" for passage in chosen] or ["- (nothing found)"]
        lines.append("")
    return "\n".join(lines)

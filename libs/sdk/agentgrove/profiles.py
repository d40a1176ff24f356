"""Subagent profiles: named kinds of child an agent delegates to with `AgentContext.task`.

A profile (`SubAgentDefinition`) says how a child of that kind runs: its runtime, model, system
prompt, capabilities, how many model calls it may make and how long its report may be. Two
profiles are built in and work offline: `explore` (a read-only search of a workspace that
reports what it found, with paths) and `reasoning` (a deterministic analysis of the given text,
changing no file). When the config file names an OpenAI-compatible endpoint (`openai.base_url`)
they run on the `openai` runtime instead. The config file's `profiles:` list adds more, and a
profile there with a built-in's name replaces it.
"""

from __future__ import annotations

import ast
import asyncio
import operator
import os
import re
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from agentgrove.results import AgentResult
from grove_core.config import ConfigError, GroveConfig, load_config
from grove_core.settings import ServiceSettings
from grove_events import DEFAULT_RETURN_BUDGET, AgentConfig, Model
from grove_events.kinds import Runtime

if TYPE_CHECKING:
    from agentgrove.context import AgentContext

NAME_PATTERN = r"^[a-z][a-z0-9_-]{0,63}$"
#: Bounds of `AgentContext.task` arguments.
MAX_DESCRIPTION = 120
MAX_PROMPT = 100_000
#: What an incomplete report begins with.
INCOMPLETE_NOTICE = "[incomplete report: the subagent {why}; what follows is all it returned]"

ReasoningEffort = Literal["minimal", "low", "medium", "high"]


class SubAgentDefinition(Model):
    """A named kind of subagent: how a child spawned by `task(..., subagent_type=name)` runs."""

    name: str = Field(description="Lowercase letters, digits, '-' and '_', starting with a letter.")
    description: str = Field(description="When to use it; shown to the delegating model.")
    system_prompt: str = Field(default="", description="The child's opening system entry.")
    model: str | None = None
    runtime: Runtime = "python"
    entrypoint: str | None = Field(default=None, description="For runtime=python.")
    command: list[str] | None = Field(default=None, description="For runtime=command or acp.")
    permissions: list[str] | None = Field(
        default=None, description="Capabilities asked for; null means the parent's."
    )
    reasoning_effort: ReasoningEffort | None = None
    max_iterations: int = Field(default=20, description="Model calls per instance (openai).")
    return_budget: int = Field(default=DEFAULT_RETURN_BUDGET, description="Characters of report.")

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not re.fullmatch(NAME_PATTERN, value):
            raise ValueError(
                f"profile name {value!r} must start with a lowercase letter and hold only "
                "lowercase letters, digits, '-' and '_' (at most 64 characters)"
            )
        return value

    @field_validator("description")
    @classmethod
    def _description(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("a profile needs a non-empty description (when to use it)")
        return value

    @field_validator("max_iterations", "return_budget")
    @classmethod
    def _positive(cls, value: int) -> int:
        if value < 1:
            raise ValueError(f"must be a positive number, not {value}")
        return value

    @model_validator(mode="after")
    def _runnable(self) -> SubAgentDefinition:
        try:
            self.agent_config()
        except ValidationError as exc:
            raise ValueError(
                f"profile {self.name!r}: " + exc.errors(include_url=False)[0]["msg"]
            ) from None
        return self

    def agent_config(self) -> AgentConfig:
        """The spawn config of a child of this profile."""
        return AgentConfig(
            runtime=self.runtime,
            entrypoint=self.entrypoint,
            command=self.command,
            model=self.model,
            profile=self.name,
            permissions=self.permissions,
            return_budget=self.return_budget,
        )


class SubAgentStop(Model):
    """Why a subagent did not finish: its end (`failed`, `stopped`, `timeout`, ...) and error."""

    reason: str
    error: str | None = None


class SubAgentResult(Model):
    """What `task` returns: the child's report within its return budget.

    `session_id` is the child's session (and agent id: `grove resume` takes it). `stop` is
    present only when the child did not finish; `content` then begins with a notice that the
    report is incomplete. `artifact` is the handle of the full output when it was stored.
    """

    session_id: str
    parent_session_id: str
    subagent_type: str
    content: str
    stop: SubAgentStop | None = None
    artifact: str | None = None


#: How an incomplete report's notice says why, by the child's end.
INCOMPLETE_WHY = {
    "failed": "failed",
    "stopped": "was stopped",
    "timeout": "ran out of time",
    "cancelled": "was cancelled before it started",
    "rejected": "was not admitted",
}


def subagent_result(
    result: AgentResult, *, parent_session_id: str, subagent_type: str, budget: int
) -> SubAgentResult:
    """A child's end as `task` returns it: its report, or an incomplete one with the notice."""
    if result.ok:
        return SubAgentResult(
            session_id=result.agent_id,
            parent_session_id=parent_session_id,
            subagent_type=subagent_type,
            content=result.summary[:budget],
            artifact=result.artifact,
        )
    body = "\n".join(
        part for part in (result.error and f"error: {result.error}", result.summary) if part
    )
    return SubAgentResult(
        session_id=result.agent_id,
        parent_session_id=parent_session_id,
        subagent_type=subagent_type,
        content=incomplete_content(INCOMPLETE_WHY.get(result.reason, result.reason), body, budget),
        stop=SubAgentStop(reason=result.reason, error=result.error),
        artifact=result.artifact,
    )


class UnknownSubagentType(LookupError):
    """`task` was asked for a profile nobody defined."""

    def __init__(self, name: str, available: Iterable[str]) -> None:
        names = ", ".join(sorted(available)) or "none"
        super().__init__(
            f"unknown subagent_type {name!r}; available: {names} "
            "(more are defined under `profiles:` in the config file)"
        )
        self.name = name


def check_task_arguments(description: str, prompt: str) -> None:
    """ValueError saying which `task` argument is out of bounds."""
    if not 1 <= len(description) <= MAX_DESCRIPTION:
        raise ValueError(
            f"task description must be 1 to {MAX_DESCRIPTION} characters (a short label), "
            f"not {len(description)}"
        )
    if not 1 <= len(prompt) <= MAX_PROMPT:
        raise ValueError(
            f"task prompt must be 1 to {MAX_PROMPT} characters (the subagent's whole brief), "
            f"not {len(prompt)}"
        )
    for name, value in (("description", description), ("prompt", prompt)):
        if not value.strip():
            raise ValueError(f"task {name} is blank; say what the subagent is to do")


def incomplete_content(why: str, body: str, budget: int) -> str:
    """An incomplete report: the notice, then as much of `body` as the budget leaves."""
    notice = INCOMPLETE_NOTICE.format(why=why)
    text = f"{notice}\n{body}" if body else notice
    return text[:budget]


# -- the profiles in force -------------------------------------------------------------------


def builtin_profiles(*, llm: bool = False) -> list[SubAgentDefinition]:
    """`explore` and `reasoning`: python agents of this module, or with `llm` on `openai`."""
    explore_prompt = (
        "You explore a workspace read-only: search its files for what the task asks about and "
        "report your findings, each with its file path and line. Change nothing."
    )
    reasoning_prompt = (
        "You analyse the text you are given and report a careful analysis: claims, questions, "
        "requirements, figures and what follows from them. You change no file."
    )

    def entry(function: str) -> dict[str, Any]:
        if llm:
            return {"runtime": "openai"}
        return {"runtime": "python", "entrypoint": f"{__name__}:{function}"}

    return [
        SubAgentDefinition(
            name="explore",
            description="Read-only search of a workspace (a path in the prompt, else the "
            "current folder) for the prompt's terms; returns findings with file paths and lines.",
            system_prompt=explore_prompt,
            permissions=["fs.read"],
            max_iterations=30,
            **entry("explore_agent"),
        ),
        SubAgentDefinition(
            name="reasoning",
            description="Analysis of the text in the prompt (claims, questions, requirements, "
            "arithmetic, key terms); changes no file and spawns nothing.",
            system_prompt=reasoning_prompt,
            permissions=[],
            reasoning_effort="high",
            max_iterations=10,
            **entry("reasoning_agent"),
        ),
    ]


def parse_profiles(
    entries: Sequence[dict[str, Any]], *, llm: bool = False
) -> dict[str, SubAgentDefinition]:
    """Built-ins, then `entries` (a config file's `profiles:`), by name; ValueError naming the
    first invalid entry and why."""
    profiles = {p.name: p for p in builtin_profiles(llm=llm)}
    seen: set[str] = set()
    for index, entry in enumerate(entries):
        try:
            profile = SubAgentDefinition.model_validate(entry)
        except ValidationError as exc:
            first = exc.errors(include_url=False)[0]
            where = ".".join(str(p) for p in first["loc"])
            label = entry.get("name") if isinstance(entry, dict) else None
            raise ValueError(
                f"profiles[{index}]"
                + (f" ({label})" if label else "")
                + (f".{where}" if where else "")
                + f": {first['msg']}"
            ) from None
        if profile.name in seen:
            raise ValueError(f"profiles[{index}]: duplicate profile name {profile.name!r}")
        seen.add(profile.name)
        profiles[profile.name] = profile
    return profiles


def profiles_of(config: GroveConfig) -> dict[str, SubAgentDefinition]:
    """The profiles a config defines, with the built-ins."""
    return parse_profiles(config.profiles, llm=config.openai.base_url is not None)


def load_profiles(path: Path | None = None) -> dict[str, SubAgentDefinition]:
    """The profiles in force: those of the config file (default: the one the services use,
    `GROVE_CONFIG_FILE` or `grove.yaml` in the data folder) with the built-ins.

    ConfigError names the file and the invalid entry.
    """
    if path is None:
        path = ServiceSettings().config_path()
    config = load_config(path)
    try:
        return profiles_of(config)
    except ValueError as exc:
        raise ConfigError(f"config file {path}: {exc}") from None


# -- the built-in agents ----------------------------------------------------------------------

# fmt: off
STOPWORDS = frozenset({
    "a", "an", "and", "are", "as", "at", "be", "by", "can", "do", "does", "find", "for", "from",
    "how", "i", "in", "into", "is", "it", "its", "look", "me", "of", "on", "or", "please",
    "search", "show", "tell", "that", "the", "their", "there", "these", "this", "to", "under",
    "was", "what", "when", "where", "which", "who", "why", "with", "workspace", "you", "your",
    "all", "any", "file", "files", "code",
})
# fmt: on
SKIPPED_FOLDERS = frozenset(
    {
        ".git",
        ".hg",
        ".svn",
        ".venv",
        "venv",
        "node_modules",
        "__pycache__",
        ".mypy_cache",
        ".ruff_cache",
        ".pytest_cache",
        ".grove",
        "dist",
        "build",
    }
)
MAX_FILES = 5000
MAX_FILE_BYTES = 1_000_000
MAX_HITS_PER_FILE = 5


@dataclass(frozen=True)
class Finding:
    """A line of a file that holds some of the searched terms."""

    path: str
    line: int
    text: str
    terms: frozenset[str]


def search_terms(prompt: str, exclude: Iterable[str] = ()) -> list[str]:
    """The words of a prompt worth searching for, in order, without repeats or stopwords."""
    skipped = {w.lower() for w in exclude}
    terms: list[str] = []
    for word in re.findall(r"[A-Za-z_][A-Za-z0-9_.-]*[A-Za-z0-9_]|[A-Za-z0-9_]{3,}", prompt):
        lowered = word.lower()
        if len(lowered) < 3 or lowered in STOPWORDS or lowered in skipped or lowered in terms:
            continue
        terms.append(lowered)
    return terms


def workspace_of(prompt: str, default: Path) -> tuple[Path, str]:
    """The folder to search, and the prompt without it: a `workspace: PATH` line, else the
    first absolute path in the prompt that is a folder, else `default`."""
    labelled = re.search(r"(?im)^\s*workspace:\s*(\S+)\s*$", prompt)
    if labelled:
        return Path(labelled.group(1)), prompt[: labelled.start()] + prompt[labelled.end() :]
    for token in re.findall(r"(/[^\s'\"`]+)", prompt):
        candidate = Path(token.rstrip(".,;:)"))
        if candidate.is_dir():
            return candidate, prompt.replace(token, " ")
    return default, prompt


def walk_files(root: Path, limit: int = MAX_FILES) -> Iterator[Path]:
    """Regular files under `root`, sorted, skipping tool and dependency folders."""
    count = 0
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = sorted(d for d in subfolders if d not in SKIPPED_FOLDERS)
        for name in sorted(names):
            if count >= limit:
                return
            path = Path(folder) / name
            if path.is_file() and not path.is_symlink():
                count += 1
                yield path


def search_file(path: Path, root: Path, terms: Sequence[str]) -> list[Finding]:
    """The lines of one text file that hold any of `terms` (a binary or huge file: none)."""
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            return []
        data = path.read_bytes()
    except OSError:
        return []
    if b"\0" in data[:4096]:
        return []
    findings = []
    relative = str(path.relative_to(root))
    name_terms = {t for t in terms if t in relative.lower()}
    for number, line in enumerate(data.decode(errors="replace").splitlines(), start=1):
        lowered = line.lower()
        found = {t for t in terms if t in lowered}
        if found:
            findings.append(Finding(relative, number, line.strip()[:200], frozenset(found)))
    if not findings and name_terms:
        findings.append(Finding(relative, 0, "(the file name matches)", frozenset(name_terms)))
    return findings


def explore(root: Path, terms: Sequence[str]) -> tuple[int, list[Finding]]:
    """Search every file under `root`: how many were read, and the findings, the files that
    hold the most distinct terms first."""
    by_file: dict[str, list[Finding]] = {}
    scanned = 0
    for path in walk_files(root):
        scanned += 1
        found = search_file(path, root, terms)
        if found:
            by_file[found[0].path] = found
    ranked = sorted(
        by_file.values(),
        key=lambda hits: (-len(frozenset().union(*(h.terms for h in hits))), hits[0].path),
    )
    return scanned, [hit for hits in ranked for hit in hits[:MAX_HITS_PER_FILE]]


def explore_report(root: Path, terms: Sequence[str], scanned: int, findings: list[Finding]) -> str:
    """The explore agent's report: what was searched, then one line per finding."""
    head = f"Searched {scanned} files under {root} for: {', '.join(terms) or '(no terms)'}."
    if not findings:
        return head + "\nNo findings."
    files = len({f.path for f in findings})
    lines = [head, f"{len(findings)} findings in {files} files:"]
    lines += [
        f"- {f.path}:{f.line}: {f.text}" if f.line else f"- {f.path}: {f.text}" for f in findings
    ]
    return "\n".join(lines)


async def explore_agent(ctx: AgentContext) -> str:
    """The built-in `explore` agent: a read-only search of a workspace for the task's terms."""
    root, rest = workspace_of(ctx.task, Path(os.environ.get("GROVE_WORKSPACE", os.getcwd())))
    if not root.is_dir():
        raise ValueError(f"workspace {root} is not a folder; name one as 'workspace: PATH'")
    terms = search_terms(rest)
    await ctx.checkpoint(f"searching {root} for {', '.join(terms) or 'nothing'}")
    scanned, findings = await asyncio.to_thread(explore, root, terms)
    return explore_report(root, terms, scanned, findings)


_OPERATORS: dict[type[ast.AST], Callable[..., Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def evaluate(expression: str) -> float | None:
    """The value of a plain arithmetic expression (numbers, + - * / // %, brackets), or None."""
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError:
        return None

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return float(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return float(_OPERATORS[type(node.op)](value(node.left), value(node.right)))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return float(_OPERATORS[type(node.op)](value(node.operand)))
        raise ValueError("not arithmetic")

    try:
        return value(tree)
    except (ValueError, ZeroDivisionError, OverflowError):
        return None


def analyse(text: str) -> str:
    """The built-in `reasoning` analysis of a text, deterministic: size, questions,
    requirements, conditions, arithmetic worked out, key terms."""
    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+|\n+", text) if s.strip()]
    words = re.findall(r"[A-Za-z][A-Za-z'-]*", text)
    questions = [s for s in sentences if s.endswith("?")]
    requirements = [
        s for s in sentences if re.search(r"\b(must|should|need|needs|required|shall)\b", s, re.I)
    ]
    conditions = [s for s in sentences if re.search(r"\b(if|unless|assum\w*|when)\b", s, re.I)]
    sums = []
    for candidate in re.findall(r"[\d(][\d\s.+\-*/%()]*[\d)]", text):
        expression = candidate.strip()
        if not re.search(r"\d\s*[-+*/%]\s*[\d(]", expression):
            continue
        result = evaluate(expression)
        if result is not None:
            sums.append(f"{expression} = {result:g}")
    counts = Counter(w.lower() for w in words if w.lower() not in STOPWORDS and len(w) > 3)
    key_terms = [f"{word} ({n})" for word, n in counts.most_common(8)]
    parts = [f"Analysis of {len(words)} words in {len(sentences)} sentences."]
    sections = (
        ("Questions", questions),
        ("Requirements", requirements),
        ("Conditions and assumptions", conditions),
        ("Arithmetic", sums),
        ("Key terms", key_terms),
    )
    for title, items in sections:
        if items:
            parts.append(f"{title}:\n" + "\n".join(f"- {item}" for item in items))
    if len(parts) == 1:
        parts.append("No questions, requirements, conditions or figures stated.")
    return "\n".join(parts)


async def reasoning_agent(ctx: AgentContext) -> str:
    """The built-in `reasoning` agent: a deterministic analysis of its task's text."""
    await ctx.checkpoint("analysing the text")
    return analyse(ctx.task)

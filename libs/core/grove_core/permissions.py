"""Capabilities of agents, as pure rules over the log: what a spawn may hold, what an approved
permission request grants, and which answers count.

A spawn's `config.permissions` names capabilities (`spawn`, `fs.read`, `fs.write`, `shell`,
`net`...); without it an agent holds what its parent holds, and a root holds every capability.
An agent's effective set is its parent's intersected with what it asks for: it can only
tighten. Using a capability it does not hold raises a `permission` HITL request up the tree; an
approving answer grants that capability to the asking agent alone (not to its children, its
siblings or its parent).

The router (which tells an agent what it holds) and the governor (which refuses a spawn whose
parent does not hold `spawn`) fold the same log with these rules, so they agree.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

#: The capability of spawning children; the governor refuses a spawn whose parent lacks it.
SPAWN = "spawn"
#: Answers that approve a permission request (compared without case or surrounding blanks).
APPROVALS = frozenset({"approve", "approved", "allow", "allowed", "yes", "y", "grant", "ok"})


def is_approval(answer: str) -> bool:
    """Whether an answer to a permission request grants it."""
    return answer.strip().lower() in APPROVALS


def effective_permissions(parent: list[str] | None, asked: list[str] | None) -> list[str] | None:
    """A child's capabilities: its parent's intersected with what it asks for (None: all)."""
    if asked is None:
        return None if parent is None else list(parent)
    if parent is None:
        return sorted(set(asked))
    return sorted(set(asked) & set(parent))


def holds(permissions: list[str] | None, granted: Collection[str], capability: str) -> bool:
    """Whether an agent with these effective `permissions` (None: all) and these grants of its
    own may use `capability`."""
    return permissions is None or capability in permissions or capability in granted


@dataclass(slots=True)
class AskedRequest:
    """A HITL request as far as capabilities are concerned: who asked, in which tree, what for,
    and whether it has been answered (the first answer stands)."""

    request_id: str
    agent_id: str
    tree_id: str
    kind: str
    capability: str | None
    answered: bool = False

    def grants(self, answer: str | None) -> str | None:
        """The capability an answer to this request grants its asker (None: nothing)."""
        if self.answered or self.kind != "permission" or self.capability is None:
            return None
        return self.capability if is_approval(answer or "") else None


def refused_answer(
    request: AskedRequest, about: str, answerer: str | None, answerer_tree: str | None
) -> str | None:
    """Why an answer cannot be taken (None when it can): it was published about another agent
    than the asker, or an agent of another tree gave it (`answerer_tree`: the tree of the agent
    named as `by`, None when `by` is no agent, e.g. a person, who may answer any)."""
    if about != request.agent_id:
        return f"answer to {request.request_id} was published about {about}, not the asker"
    if answerer_tree is not None and answerer_tree != request.tree_id:
        return (
            f"agent {answerer} of tree {answerer_tree} may not answer a question of "
            f"tree {request.tree_id}"
        )
    return None


def spawn_refusal(
    parent: str, permissions: list[str] | None, granted: Collection[str]
) -> str | None:
    """Why a spawn by `parent` is refused for want of the `spawn` capability (None: it holds it)."""
    if holds(permissions, granted, SPAWN):
        return None
    held = ", ".join(sorted({*(permissions or []), *granted})) or "none"
    return (
        f"refused: parent {parent} does not hold the '{SPAWN}' permission (it holds: {held}); "
        f"it must ask for '{SPAWN}' (a permission request) and have it approved before spawning"
    )

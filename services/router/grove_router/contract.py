"""The router's subjects, for its AsyncAPI document (`make asyncapi`)."""

from __future__ import annotations

from grove_core.asyncapi import Channel, Contract, asyncapi_app
from grove_events import EVENT_CLASSES, kind_wildcard, rpc_subject
from grove_router.service import NAME, Router

#: The request-reply verbs the router answers on `grove.rpc.router.<verb>`.
VERBS = ("inbox", "summary", "hierarchy", "tree", "query", "hitl", "pending", "permissions")


def _doc(verb: str) -> str:
    """The verb's request and reply, as its handler documents them."""
    text = getattr(Router, verb).__doc__ or ""
    return " ".join(text.split())


CONTRACT = Contract(
    service=NAME,
    description=(
        "Keeps the agent tree and each agent's subscriptions, delivers what they match to "
        "durable inboxes in log order, routes questions for a human up the tree and answers "
        "back to the asker, and folds permissions and their grants. Answers queries about "
        "agents, trees and pending questions."
    ),
    reads=tuple(
        Channel(kind_wildcard(kind), f"Every {kind} event, folded in log order.", model)
        for kind, model in EVENT_CLASSES.items()
    ),
    answers=tuple(Channel(rpc_subject(NAME, verb), _doc(verb), name=verb) for verb in VERBS),
)

#: `faststream docs gen grove_router.contract:app`
app = asyncapi_app(CONTRACT)

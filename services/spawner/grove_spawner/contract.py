"""The spawner's subjects, for its AsyncAPI document (`make asyncapi`)."""

from __future__ import annotations

from grove_core.asyncapi import Channel, Contract, asyncapi_app
from grove_events import (
    ControlEvent,
    ForkEvent,
    HitlEvent,
    MessageEvent,
    SpawnEvent,
    StatusEvent,
    TerminateEvent,
    kind_wildcard,
)
from grove_spawner.service import HEARTBEAT_SUBJECT

CONTRACT = Contract(
    service="spawner",
    description=(
        "Runs admitted agents on their runtime (python, command, acp, openai), exactly once "
        "per admission: every replica folds the admissions, and each admission's owner among "
        "the replicas heard from (rendezvous hashing over their heartbeats) starts it. "
        "Reports their lifecycle, stops, pauses, resumes and forks them, and ends the agents "
        "of a spawner that stopped sending heartbeats."
    ),
    reads=(
        Channel(
            kind_wildcard("status"),
            "Admissions (folded, then started by their owner), and every other status for "
            "the fold of started agents.",
            StatusEvent,
        ),
        Channel(kind_wildcard("spawn"), "What an admitted agent runs.", SpawnEvent),
        Channel(kind_wildcard("fork"), "What an admitted fork runs, from its source.", ForkEvent),
        Channel(kind_wildcard("control"), "stop, pause_all, resume_all.", ControlEvent),
        Channel(kind_wildcard("terminate"), "Ends decided elsewhere.", TerminateEvent),
    ),
    appends=(
        Channel(
            kind_wildcard("status"),
            "started (guarded by the admission's sequence: one start per admission), "
            "checkpoint, blocked, discovery, completed, failed, paused, resumed.",
            StatusEvent,
            name="lifecycle",
        ),
        Channel(
            kind_wildcard("terminate"),
            "completed, failed (error, attempted, partial_results), stopped; the result cut "
            "to the return budget with the full text as an artifact.",
            TerminateEvent,
            name="ends",
        ),
        Channel(kind_wildcard("spawn"), "Children spawned by the agents it runs.", SpawnEvent),
        Channel(kind_wildcard("fork"), "Forks asked for by the agents it runs.", ForkEvent),
        Channel(kind_wildcard("control"), "Stops and injections by its agents.", ControlEvent),
        Channel(kind_wildcard("message"), "Messages sent by its agents.", MessageEvent),
        Channel(kind_wildcard("hitl"), "Questions asked by its agents.", HitlEvent),
    ),
    answers=(
        Channel(
            HEARTBEAT_SUBJECT,
            'Heartbeats between replicas: {"spawner_id", "agents", "takes_admissions"}, '
            "published every GROVE_HEARTBEAT_INTERVAL seconds, at once to a peer heard for "
            "the first time, and with takes_admissions false when a spawner shuts down.",
            name="heartbeat",
        ),
    ),
)

#: `faststream docs gen grove_spawner.contract:app`
app = asyncapi_app(CONTRACT)

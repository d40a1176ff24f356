"""The resource-governor's subjects, for its AsyncAPI document (`make asyncapi`)."""

from __future__ import annotations

from grove_core.asyncapi import Channel, Contract, asyncapi_app
from grove_events import (
    ControlEvent,
    ForkEvent,
    HitlEvent,
    SpawnEvent,
    StatusEvent,
    TerminateEvent,
    kind_wildcard,
)
from grove_governor.service import STATUS_SUBJECT

CONTRACT = Contract(
    service="governor",
    description=(
        "Admits, queues or rejects every spawn, fork and resume under the resource limits of "
        "the config file, stops agents over their runtime or token limits, and holds all "
        "admissions while paused. Its state is a fold of the GROVE stream, replayed on start."
    ),
    reads=(
        Channel(kind_wildcard("spawn"), "Spawns to decide on.", SpawnEvent),
        Channel(
            kind_wildcard("fork"),
            "Forks to decide on; they count against the same tree.",
            ForkEvent,
        ),
        Channel(
            kind_wildcard("status"),
            "Lifecycle facts (started, paused...) and usage reports (details.tokens).",
            StatusEvent,
        ),
        Channel(kind_wildcard("terminate"), "Ends, which free capacity.", TerminateEvent),
        Channel(
            kind_wildcard("control"),
            "stop (before start: cancelled), resume (admitted again), pause_all, resume_all.",
            ControlEvent,
        ),
        Channel(
            kind_wildcard("hitl"),
            "Permission requests and their answers: an approved request for `spawn` lets that "
            "agent alone spawn; a spawn whose parent does not hold `spawn` is rejected.",
            HitlEvent,
        ),
    ),
    appends=(
        Channel(
            kind_wildcard("status"),
            "Decisions: queued, admitted, rejected, stopped, timeout_notice; each guarded by "
            "the agent's expected last sequence, so exactly one decision wins.",
            StatusEvent,
            name="decisions",
        ),
        Channel(
            kind_wildcard("terminate"),
            "Ends it decides: rejected, cancelled (stopped before start), timeout.",
            TerminateEvent,
            name="ends",
        ),
    ),
    answers=(
        Channel(
            STATUS_SUBJECT,
            'Resource status. Request {"agent_id"?}; reply {"global": {agents_running, '
            'capacity, utilization, queued, paused}, "self": {agent_id, phase, '
            "children_running, children_limit, runtime_elapsed, tokens, tree_tokens}}.",
            name="status",
        ),
    ),
)

#: `faststream docs gen grove_governor.contract:app`
app = asyncapi_app(CONTRACT)

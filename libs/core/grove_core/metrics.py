"""Prometheus metrics shared by the services; each service adds its domain's own beside them."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

EVENTS_APPLIED = Counter(
    "grove_events_applied_total", "Events folded into a projection.", ["projection"]
)
PROJECTION_SEQ = Gauge(
    "grove_projection_applied_seq", "Last stream sequence a projection has applied.", ["projection"]
)
PROJECTION_LAG = Gauge(
    "grove_projection_lag_events",
    "Events in the log not yet applied by a projection.",
    ["projection"],
)
PROJECTION_WRITE_ERRORS = Counter(
    "grove_projection_write_errors_total",
    "Writes of a projection the database refused (each retried).",
    ["projection"],
)
PROJECTION_REBUILDS = Counter(
    "grove_projection_rebuilds_total",
    "Stored projections deleted at start and rebuilt from the log, by cause.",
    ["projection", "cause"],
)
CATCH_UP_HELPER_FAILURES = Counter(
    "grove_catch_up_helper_failures_total",
    "Catch-ups whose helper process stopped early (the projection read on itself).",
    ["projection"],
)
APPEND_BATCHES = Counter(
    "grove_append_batches_total",
    "Atomic batches of appends (GROVE_APPEND_BATCH_FROM), by outcome: stored, or refused "
    "(its appends were then sent one by one).",
    ["outcome"],
)
REPLAY_SECONDS = Gauge(
    "grove_replay_duration_seconds",
    "Time the last start-up replay took to catch up.",
    ["projection"],
)
DEADLETTERS = Counter(
    "grove_deadletters_total", "Invalid messages seen on grove subjects.", ["service", "kind"]
)
SPAWNS = Counter("grove_spawns_total", "Admission decisions by outcome.", ["outcome"])
AGENTS = Gauge("grove_agents", "Agents known to a service, by state.", ["service", "state"])
SPAWN_TO_STARTED = Histogram(
    "grove_spawn_to_started_seconds",
    "Time from a spawn event to its agent's start.",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
RUNTIME_ERRORS = Counter(
    "grove_runtime_errors_total", "Agents that ended failed, by runtime.", ["runtime"]
)
TOKENS_USED = Counter("grove_tokens_used_total", "Tokens reported by runtimes.", ["runtime"])
QUEUE_DEPTH = Gauge("grove_queue_depth", "Spawns waiting for admission (pending or queued).")

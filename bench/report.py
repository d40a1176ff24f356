"""The figures of a benchmark run, each beside its baseline and goal, and their table."""

from __future__ import annotations

import math
from typing import Any

#: Bytes of state per tracked agent the governor and the tree should stay within.
MEMORY_GOAL_BYTES = 2048
AGENTS_PER_S_GOAL = 2000.0


def _figure(
    name: str,
    value: float,
    unit: str,
    *,
    baseline: float | None = None,
    baseline_name: str = "",
    goal: str = "",
    met: bool | None = None,
) -> dict[str, Any]:
    ratio = value / baseline if baseline and not math.isnan(value) else None
    return {
        "figure": name,
        "value": value,
        "unit": unit,
        "baseline": baseline,
        "baseline_name": baseline_name,
        "ratio": None if ratio is None else round(ratio, 3),
        "goal": goal,
        "met": met,
    }


def figures(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The headline figures of `results`."""
    out: list[dict[str, Any]] = []
    for mode, run in results["runs"].items():
        raw, latency, burst = run["raw"], run["spawn_to_started"], run["burst"]
        hop = raw["two_hop"]
        tag = f"[{mode}]"
        out.append(
            _figure(f"{tag} raw awaited publish p50", raw["awaited_publish"]["p50_ms"], "ms")
        )
        out.append(
            _figure(f"{tag} raw awaited publish p99", raw["awaited_publish"]["p99_ms"], "ms")
        )
        p50 = latency["p50_ms"]
        p99 = latency["p99_ms"]
        out.append(
            _figure(
                f"{tag} spawn→started p50",
                p50,
                "ms",
                baseline=hop["p50_ms"],
                baseline_name="raw two-hop p50",
                goal="≤ 2x baseline",
                met=p50 <= 2 * hop["p50_ms"],
            )
        )
        out.append(
            _figure(
                f"{tag} spawn→started p99",
                p99,
                "ms",
                baseline=hop["p99_ms"],
                baseline_name="raw two-hop p99",
                goal="≤ 3x baseline",
                met=p99 <= 3 * hop["p99_ms"],
            )
        )
        # Context, not goals: the same round trips with each relay in its own process.
        for name, key in (
            ("two-hop, relay in its own process", "two_hop_processes"),
            ("three-hop, two relay processes", "three_hop_processes"),
            ("three-hop, two relays, three listening processes", "three_hop_listened"),
        ):
            for quantile in ("p50", "p99"):
                out.append(
                    _figure(f"{tag} raw {name} {quantile}", raw[key][f"{quantile}_ms"], "ms")
                )
        for shape, key, trip in (
            ("its own shape", "three_hop_processes", "three-hop"),
            ("its shape and readers", "three_hop_listened", "listened three-hop"),
        ):
            for quantile, value in (("p50", p50), ("p99", p99)):
                out.append(
                    _figure(
                        f"{tag} spawn→started {quantile}, against {shape}",
                        value,
                        "ms",
                        baseline=raw[key][f"{quantile}_ms"],
                        baseline_name=f"raw {trip} {quantile}",
                    )
                )
        out.append(
            _figure(
                f"{tag} burst spawn→terminate",
                burst["agents_per_s"],
                "agents/s",
                goal=f"≥ {AGENTS_PER_S_GOAL:g}",
                met=burst["complete"] and burst["agents_per_s"] >= AGENTS_PER_S_GOAL,
            )
        )
        out.append(
            _figure(
                f"{tag} burst log appends",
                burst["log_events_per_s"],
                "events/s",
                baseline=raw["publish_async"]["msgs_per_s"],
                baseline_name="raw publish_async",
            )
        )
    rebuilt = results.get("rebuild", {"services": {}})
    replay = rebuilt.get("raw_replay", {}).get("msgs_per_s", 0.0)
    for service, figure in rebuilt["services"].items():
        out.append(
            _figure(
                f"rebuild {service}",
                figure["events_per_s"],
                "events/s",
                baseline=replay,
                baseline_name="raw ordered replay",
                goal="≥ 0.5x baseline",
                met=figure["events_per_s"] >= replay / 2,
            )
        )
    tracked = results.get("memory", {}).get("tracked", [])
    for state in ("governor", "router") if tracked else ():
        largest = tracked[-1]
        per_agent = largest[state]["bytes_per_agent"]
        out.append(
            _figure(
                f"memory per agent, {state} ({largest['agents']} tracked)",
                per_agent,
                "bytes",
                goal=f"≤ {MEMORY_GOAL_BYTES}",
                met=per_agent <= MEMORY_GOAL_BYTES,
            )
        )
    return out


def _num(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 100 else f"{value:,.0f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))
    body = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join([line, "  ".join("-" * w for w in widths), *body])


def render(results: dict[str, Any]) -> str:
    """The report as text: durability, figures, stack memory, scale."""
    parts: list[str] = []
    for mode, run in results["runs"].items():
        server = run["server"]
        parts.append(
            f"nats-server {server['version']} [{mode}]: sync_always={server['sync_always']}, "
            f"sync_interval={server['sync_interval_s']:g}s, "
            f"GOMAXPROCS={server.get('gomaxprocs')} of {server.get('cores')} cores; "
            f"the services' and the client's "
            f"GROVE_APPEND_BATCH_FROM={run.get('append_batch_from', 0)}"
        )
    parts.append(
        f"load average: {results['meta']['load_average_at_start']} at start, "
        f"{results['meta']['load_average_at_end']} at end ({results['meta']['cpus']} CPUs)"
    )
    rows = [
        [
            f["figure"],
            f"{_num(f['value'])} {f['unit']}",
            f"{_num(f['baseline'])} ({f['baseline_name']})" if f["baseline"] else "-",
            _num(f["ratio"]),
            f["goal"] or "-",
            {True: "yes", False: "NO", None: "-"}[f["met"]],
        ]
        for f in results["figures"]
    ]
    parts.append("")
    parts.append(_table(["figure", "value", "baseline", "ratio", "goal", "met"], rows))
    for mode, run in results["runs"].items():
        rss = run["rss_kib"]
        total = sum(v for v in rss.values() if v)
        listed = ", ".join(f"{k} {_num(v / 1024 if v else None)} MiB" for k, v in rss.items())
        parts.append(
            f"\nstack RSS after the burst [{mode}]: {listed}; total {total / 1024:.1f} MiB"
        )
        cpu = run["burst"].get("cpu_ms_per_agent", {})
        known = [v for v in cpu.values() if v is not None]
        if known:
            spent = ", ".join(f"{k} {_num(v)}" for k, v in cpu.items())
            client = run["burst"].get("client_cpu_ms_per_agent")
            parts.append(
                f"CPU per agent in the burst [{mode}], ms: {spent}; total {sum(known):.2f} "
                f"(the benchmark's own client, not counted: {_num(client)})"
            )
    fan = results["runs"].get("default", {}).get("fan_out", [])
    memory = results.get("memory")
    if fan:
        mem_fan = {row["agents"] - 1: row for row in memory["fan_out"]} if memory else {}

        def per_child(children: int, state: str) -> str:
            row = mem_fan.get(children)
            return _num(row[state]["bytes_per_agent"]) if row else "-"

        parts.append("\nscale: fan-out (children of one parent, live stack; memory per child)")
        parts.append(
            _table(
                ["children", "seconds", "agents/s", "governor B/agent", "router B/agent"],
                [
                    [
                        _num(row["children"]),
                        _num(row["seconds"]),
                        _num(row["agents_per_s"]),
                        per_child(row["children"], "governor"),
                        per_child(row["children"], "router"),
                    ]
                    for row in fan
                ],
            )
        )
    if memory:
        parts.append(f"\nscale: agents tracked ({memory['method']})")
        parts.append(
            _table(
                [
                    "agents",
                    "state",
                    "fold events/s",
                    "bytes/agent",
                    "MiB",
                    "decide ms (clock)",
                    "(event)",
                ],
                [
                    [
                        _num(row["agents"]),
                        state,
                        _num(row[state]["fold_events_per_s"]),
                        _num(row[state]["bytes_per_agent"]),
                        _num(row[state]["total_mib"]),
                        _num(row[state].get("decide_ms")),
                        _num(row[state].get("decide_on_event_ms")),
                    ]
                    for row in memory["tracked"]
                    for state in ("governor", "router")
                ],
            )
        )
    rebuilt = results.get("rebuild")
    if rebuilt:
        parts.append(
            f"\nrebuild log: {rebuilt['generate']['events']:,} events appended at "
            f"{rebuilt['generate']['events_per_s']:,.0f}/s; EventLog.read "
            f"{rebuilt['log_read']['events_per_s']:,.0f}/s, read+decode "
            f"{rebuilt['log_read_decoded']['events_per_s']:,.0f}/s"
        )
        helped = [
            name
            for name, rebuild in rebuilt.get("services", {}).items()
            if rebuild.get("catch_up_helper")
        ]
        parts.append(
            "catch-ups read by a helper process (GROVE_CATCH_UP_HELPER_MIN): "
            + (", ".join(helped) if helped else "none")
        )
    return "\n".join(parts)

"""Run the benchmark: `python -m bench [--quick] [--out FILE]`.

One run measures, on a fresh local nats-server each time:

1. for each durability setting (the server's default, then `sync_interval: always`): the raw
   nats-py baselines, then AgentGrove with all its services running (spawn → started latency,
   a burst of trivial agents, and with the default setting the fan-out scale), and the RSS of
   the nats-server and of every service process;
2. each service's projection rebuild from a large log, against the raw ordered replay of it;
3. memory per tracked agent and fold time of the governor's and the tree's state, at growing
   numbers of agents.

It prints a table (figure, baseline, ratio, goal) and writes the results as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import sys
import tempfile
import time
import urllib.request
from collections.abc import Coroutine
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import nats
import uvloop

from bench import memory, plane, raw, rebuild
from bench.loggen import publish_log
from bench.report import figures, render
from grove_core.catchup import CatchUpHelper
from grove_core.log import EventLog
from grove_core.natsserver import LocalNatsServer
from grove_core.settings import NatsAccess, ServiceSettings

DEFAULT_OUT = Path(__file__).resolve().parent / "results.json"
#: Processes that read each event of spawn → started without acting on it: the router and the
#: artifact-store read all three, and the governor or the spawner's projection the ones the
#: other acts on.
LISTENERS = 3


@dataclass(frozen=True)
class Counts:
    """How much each part of the benchmark measures."""

    latency_samples: int
    spawn_samples: int
    async_msgs: int
    burst_agents: int
    rebuild_events: int
    tracked: tuple[int, ...]
    fan_out: tuple[int, ...]
    timeout_s: float


FULL = Counts(
    latency_samples=2000,
    spawn_samples=200,
    async_msgs=50_000,
    burst_agents=5000,
    rebuild_events=1_000_000,
    tracked=(1000, 10_000, 100_000),
    fan_out=(1, 10, 100, 1000),
    timeout_s=300.0,
)
QUICK = Counts(
    latency_samples=50,
    spawn_samples=10,
    async_msgs=2000,
    burst_agents=50,
    rebuild_events=5000,
    tracked=(100, 1000),
    fan_out=(1, 10),
    timeout_s=60.0,
)
MODES = ("default", "always")
#: GROVE_APPEND_BATCH_FROM under each sync setting, as the README advises: the services and
#: the benchmark's client use it alike.
APPEND_BATCH_FROM = {"default": 0, "always": 16}
#: What a run can measure: the stack under each sync setting, rebuilds, state memory.
PARTS = frozenset({*MODES, "rebuild", "memory"})


def server_sync(server: LocalNatsServer) -> dict[str, Any]:
    """The server's JetStream sync setting, version and Go scheduler slots (`GOMAXPROCS`)
    against the machine's cores, as its /varz reports them."""
    url = f"http://{server.host}:{server.monitor_port}/varz"
    with urllib.request.urlopen(url, timeout=5) as resp:
        varz = json.load(resp)
    config = varz.get("jetstream", {}).get("config", {})
    return {
        "version": varz.get("version"),
        "sync_always": bool(config.get("sync_always", False)),
        "sync_interval_s": config.get("sync_interval", 0) / 1e9,
        "gomaxprocs": varz.get("gomaxprocs"),
        "cores": varz.get("cores"),
    }


def cpu_per_agent(
    before: dict[str, float | None], after: dict[str, float | None], agents: int
) -> dict[str, float | None]:
    """Milliseconds of CPU each process spent per agent of a burst."""
    out: dict[str, float | None] = {}
    for name, start in before.items():
        end = after.get(name)
        used = None if start is None or end is None or not agents else end - start
        out[name] = None if used is None else round(used * 1000 / agents, 3)
    return out


def note(message: str) -> None:
    """Progress on stderr."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


async def durability_run(mode: str, counts: Counts, folder: Path, spawners: int) -> dict[str, Any]:
    """Raw baselines and the running stack on one server with one sync setting."""
    server = LocalNatsServer(folder / mode / "nats", sync_always=mode == "always").start()
    out: dict[str, Any] = {}
    try:
        out["server"] = server_sync(server)
        note(f"{mode}: raw baselines ({out['server']})")
        relay = await nats.connect(server.url, name="bench-relay")
        client = await nats.connect(server.url, name="bench-client")
        try:
            await raw.ensure_stream(client)
            out["raw"] = {
                "awaited_publish": await raw.awaited_publish(client, counts.latency_samples),
                "two_hop": await raw.two_hop(relay, client, counts.latency_samples),
                "two_hop_processes": await raw.relayed_round_trip(
                    client, server.url, 1, counts.latency_samples
                ),
                "three_hop_processes": await raw.relayed_round_trip(
                    client, server.url, 2, counts.latency_samples
                ),
                "three_hop_listened": await raw.relayed_round_trip(
                    client, server.url, 2, counts.latency_samples, listeners=LISTENERS
                ),
                "publish_async": await raw.pipelined_publish(client, counts.async_msgs),
            }
        finally:
            await relay.close()
            await client.close()
        log = await EventLog.connect(server.url, name="bench")
        await log.ensure_stream()
        out["append_batch_from"] = APPEND_BATCH_FROM[mode]
        # The benchmark's client sends the spawns as a user's producer would, with the same
        # setting as the services (`GroveClient.connect` reads GROVE_APPEND_BATCH_FROM too).
        log.acks.batch_from = out["append_batch_from"]
        note(f"{mode}: starting the stack (GROVE_APPEND_BATCH_FROM={out['append_batch_from']})")
        env = {"GROVE_APPEND_BATCH_FROM": str(out["append_batch_from"])}
        async with plane.running_stack(folder / mode / "stack", server.url, spawners, env) as stack:
            note(f"{mode}: spawn → started, {counts.spawn_samples} agents one at a time")
            async with plane.watching(log) as watch:
                out["spawn_to_started"] = await plane.spawn_to_started(
                    log, watch, counts.spawn_samples
                )
            note(f"{mode}: burst of {counts.burst_agents} agents")
            pids = plane.stack_pids(stack, server.process.pid if server.process else None)
            async with plane.watching(log, starts=False) as ends:
                cpu_before, client_before = plane.stack_cpu(pids), time.process_time()
                batches_before = log.acks.batches
                out["burst"] = await plane.burst(log, ends, counts.burst_agents, counts.timeout_s)
                out["burst"]["client_batches"] = log.acks.batches - batches_before
                ended = out["burst"]["ended"]
                out["burst"]["cpu_ms_per_agent"] = cpu_per_agent(
                    cpu_before, plane.stack_cpu(pids), ended
                )
                client_s = time.process_time() - client_before
                out["burst"]["client_cpu_ms_per_agent"] = (
                    round(client_s * 1000 / ended, 3) if ended else None
                )
            if mode == "default":
                out["fan_out"] = []
                async with plane.watching(log) as watch:
                    for children in counts.fan_out:
                        note(f"{mode}: fan-out of {children}")
                        out["fan_out"].append(
                            await plane.fan_out(log, watch, children, counts.timeout_s)
                        )
            pid = server.process.pid if server.process else None
            out["rss_kib"] = plane.stack_rss(stack, pid)
        await log.close()
    finally:
        server.stop()
    return out


async def rebuild_run(counts: Counts, folder: Path) -> dict[str, Any]:
    """A large log, its raw replay, and each service's projection rebuild from it."""
    server = LocalNatsServer(folder / "rebuild" / "nats").start()
    out: dict[str, Any] = {}
    try:
        log = await EventLog.connect(server.url, name="bench-rebuild")
        # As a service sets it, from GROVE_CATCH_UP_HELPER_MIN (0: the service reads alone).
        helper_min = ServiceSettings().catch_up_helper_min
        if helper_min > 0:
            log.helper = CatchUpHelper(NatsAccess(server.url), helper_min)
        try:
            await log.ensure_stream()
            note(f"rebuild: appending {counts.rebuild_events} events")
            out["generate"] = await publish_log(log, counts.rebuild_events)
            last = await log.last_seq()
            note("rebuild: raw ordered replay")
            out["raw_replay"] = await raw.ordered_replay(
                log.nc, log.stream, "grove.>", last, counts.timeout_s * 3
            )
            out["log_read"] = await rebuild.read_rate(log, last, decoded=False)
            out["log_read_decoded"] = await rebuild.read_rate(log, last, decoded=True)
            out["services"] = {}
            for service in rebuild.PROJECTIONS:
                note(f"rebuild: {service}")
                out["services"][service] = await rebuild.rebuild(
                    log, service, folder / "rebuild", counts.timeout_s * 3
                )
        finally:
            await log.close()
    finally:
        server.stop()
    return out


def memory_run(counts: Counts) -> dict[str, Any]:
    """State memory and fold time by agents tracked and by fan-out."""
    out: dict[str, Any] = {"method": "tracemalloc (Python heap kept by the state)"}
    out["tracked"] = []
    for agents in counts.tracked:
        note(f"memory: {agents} agents tracked")
        out["tracked"].append(memory.tracked(agents, family=10))
    out["fan_out"] = []
    for children in counts.fan_out:
        out["fan_out"].append(memory.tracked(children + 1, family=children + 1))
    return out


async def bench(
    counts: Counts, folder: Path, spawners: int, parts: frozenset[str] = PARTS
) -> dict[str, Any]:
    """The whole benchmark."""
    results: dict[str, Any] = {
        "meta": {
            "started": datetime.now(UTC).isoformat(timespec="seconds"),
            "counts": asdict(counts),
            "spawners": spawners,
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_average_at_start": os.getloadavg(),
            "client_event_loop": "uvloop",
            "parts": sorted(parts),
        },
        "runs": {},
    }
    for mode in MODES:
        if mode in parts:
            results["runs"][mode] = await durability_run(mode, counts, folder, spawners)
    if "rebuild" in parts:
        results["rebuild"] = await rebuild_run(counts, folder)
    if "memory" in parts:
        results["memory"] = memory_run(counts)
    results["meta"]["load_average_at_end"] = os.getloadavg()
    results["figures"] = figures(results)
    return results


async def _until_signal(work: Coroutine[Any, Any, dict[str, Any]]) -> dict[str, Any]:
    """Run `work`; SIGTERM or SIGINT cancels it, so that it stops what it started."""
    task = asyncio.ensure_future(work)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    return await task


def main(argv: list[str] | None = None) -> None:
    """Command line entry point."""
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small counts (CI smoke check)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where to write JSON")
    parser.add_argument("--spawners", type=int, default=1, help="spawner replicas (default 1)")
    parser.add_argument(
        "--parts",
        default=",".join(sorted(PARTS)),
        help=f"comma-separated parts to run (default all: {', '.join(sorted(PARTS))})",
    )
    args = parser.parse_args(argv)
    if args.spawners < 1:
        parser.error("--spawners must be at least 1")
    parts = frozenset(part.strip() for part in args.parts.split(",") if part.strip())
    if not parts or not parts <= PARTS:
        parser.error(f"--parts takes some of {', '.join(sorted(PARTS))}; got {args.parts!r}")
    counts = QUICK if args.quick else FULL
    uvloop.install()
    with tempfile.TemporaryDirectory(prefix="grove-bench-") as tmp:
        try:
            results = asyncio.run(_until_signal(bench(counts, Path(tmp), args.spawners, parts)))
        except (asyncio.CancelledError, KeyboardInterrupt):
            print("benchmark interrupted; everything it started is stopped", file=sys.stderr)
            sys.exit(130)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(render(results))
    print(f"\nresults written to {args.out}")

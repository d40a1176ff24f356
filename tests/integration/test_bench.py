"""The benchmark's smoke check: `python -m bench --quick` runs and writes valid results.

Timings are never asserted here (the machine may be loaded); only that every part ran and
that the report holds what it claims to.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parent.parent.parent


def test_quick_bench_writes_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    bench = subprocess.Popen(
        [sys.executable, "-m", "bench", "--quick", "--out", str(out)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = bench.communicate(timeout=100)
    except subprocess.TimeoutExpired:
        bench.terminate()  # the bench stops the servers and services it started
        _, stderr = bench.communicate(timeout=30)
        pytest.fail(f"the quick bench did not finish in 100 s:\n{stderr[-3000:]}")
    assert bench.returncode == 0, stderr[-3000:]
    assert "spawn→started p50" in stdout
    results = json.loads(out.read_text())

    runs = results["runs"]
    assert runs["default"]["server"]["sync_always"] is False
    assert runs["always"]["server"]["sync_always"] is True
    assert all(run["server"]["gomaxprocs"] >= 1 for run in runs.values())
    assert (runs["default"]["append_batch_from"], runs["always"]["append_batch_from"]) == (0, 16)
    # The client's spawns go out as a producer under that setting sends them.
    assert runs["default"]["burst"]["client_batches"] == 0
    assert runs["always"]["burst"]["client_batches"] > 0
    counts = results["meta"]["counts"]
    for run in runs.values():
        for trip in (
            "two_hop",
            "two_hop_processes",
            "three_hop_processes",
            "three_hop_listened",
        ):
            assert run["raw"][trip]["samples"] == counts["latency_samples"]
        assert run["spawn_to_started"]["samples"] == counts["spawn_samples"]
        burst = run["burst"]
        assert burst["complete"], burst
        assert burst["ended"] == counts["burst_agents"]
        # every agent leaves at least spawn, admitted, started and terminate in the log
        assert burst["log_events"] >= 4 * counts["burst_agents"]
        assert set(run["rss_kib"]) >= {"nats-server", "governor", "router", "artifacts"}
        cpu = burst["cpu_ms_per_agent"]
        assert set(cpu) == set(run["rss_kib"])
        assert all(ms is not None and ms >= 0 for ms in cpu.values()), cpu
    assert [row["children"] for row in runs["default"]["fan_out"]] == counts["fan_out"]
    assert all(row["complete"] for row in runs["default"]["fan_out"])

    rebuilt = results["rebuild"]
    events = rebuilt["generate"]["events"]
    assert rebuilt["raw_replay"]["count"] == events
    assert rebuilt["log_read_decoded"]["events"] == events
    for service in ("governor", "spawner", "router", "artifacts"):
        assert rebuilt["services"][service]["applied_seq"] == events

    tracked = results["memory"]["tracked"]
    assert [row["agents"] for row in tracked] == counts["tracked"]
    for row in tracked:
        for state in ("governor", "router"):
            assert row[state]["bytes_per_agent"] > 0

    names = {figure["figure"] for figure in results["figures"]}
    assert "rebuild governor" in names
    for figure in results["figures"]:
        assert isinstance(figure["value"], int | float)
        assert not math.isnan(figure["value"]), figure
        if figure["baseline"] is not None:
            assert figure["ratio"] == pytest.approx(
                figure["value"] / figure["baseline"], rel=1e-2, abs=1e-3
            )  # the report rounds ratios to three decimals

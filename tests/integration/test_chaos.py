"""The short chaos runs CI does: agent trees (asking questions, messaging, storing artifacts)
while services are SIGKILLed and nats-server restarts once, on one server and on a three-node
cluster (the stream with three replicas, as in production; a node is killed and comes back,
and the services send their appends in atomic batches, `GROVE_APPEND_BATCH_FROM=1`); every
promise must hold at the end. `make chaos` runs the long one, and `make chaos
CHAOS_ARGS=--cluster` the long one on a cluster."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("cluster", [False, True], ids=["one-server", "three-node-cluster"])
def test_a_short_chaos_run_keeps_every_promise(tmp_path: Path, cluster: bool) -> None:
    summary_file = tmp_path / "chaos.json"
    result = subprocess.run(
        [sys.executable, "-m", "chaos", "--quick", "--dir", str(tmp_path / "run"),
         "--out", str(summary_file),
         *(["--cluster", "--append-batch-from", "1"] if cluster else [])],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )  # fmt: skip
    print(result.stdout)
    summary = json.loads(summary_file.read_text())
    assert summary["checks"] == dict.fromkeys(summary["checks"], True), result.stdout
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    assert summary["agents"] >= 250
    assert sum(summary["kills"].values()) >= 5
    assert summary["nats_restarts"] == 1
    assert summary["cluster"] is cluster
    assert summary["append_batch_from"] == (1 if cluster else 0)
    # The workload talks: questions answered by the scripted caller, messages, artifacts.
    assert summary["questions"] >= 10
    assert summary["answers_given"] >= 10
    assert summary["messages"] >= 10
    assert summary["artifacts"] >= 10
    # Every failure is put down to a cause in the summary.
    assert sum(summary["failure_causes"].values()) <= summary["ends"].get("failed", 0)
    assert bool(summary["failure_causes"]) == bool(summary["ends"].get("failed", 0))

"""docs/metrics.md lists exactly the metrics the services export."""

from __future__ import annotations

import re
from pathlib import Path

from tests.deploy.test_deploy import SUFFIXES, registered_metrics

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def exported_families() -> set[str]:
    """AgentGrove's metric names as exported (counters with their `_total`)."""
    samples = [n for n in registered_metrics() if n.startswith("grove_")]
    histogram_parts = [s for s in SUFFIXES["histogram"] if s != "_created"]
    families = set()
    for sample in samples:
        if sample.endswith("_created"):
            continue
        part = next((s for s in histogram_parts if sample.endswith(s)), "")
        families.add(sample.removesuffix(part) if part else sample)
    return families


def test_every_exported_metric_is_documented_and_nothing_else() -> None:
    documented = set(re.findall(r"^\| `(grove_[a-z_]+)` \|", DOC.read_text(), flags=re.MULTILINE))
    exported = exported_families()
    assert exported - documented == set(), "exported but not in docs/metrics.md"
    assert documented - exported == set(), "in docs/metrics.md but not exported"

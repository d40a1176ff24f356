"""Where the tests' nats-server comes from (GROVE_TEST_DOCKER, the `local_nats` marker, and
whether a Docker engine answers)."""

from __future__ import annotations

import pytest

from tests.conftest import nats_source

pytestmark = pytest.mark.unit

NO_ENGINE = "no Docker engine answers (DockerException: no socket)"


@pytest.mark.parametrize(
    ("mode", "needs_the_process", "problem", "source"),
    [
        ("auto", False, None, "docker"),
        ("auto", False, NO_ENGINE, "binary"),
        ("auto", True, None, "binary"),
        ("always", False, None, "docker"),
        ("always", True, None, "binary"),
        ("never", False, None, "binary"),
        ("never", False, NO_ENGINE, "binary"),
    ],
)
def test_the_source_of_the_nats_server(
    mode: str, needs_the_process: bool, problem: str | None, source: str
) -> None:
    assert nats_source(mode, needs_the_process, problem) == source


def test_always_without_an_engine_fails_the_test_saying_why() -> None:
    with pytest.raises(pytest.fail.Exception, match="GROVE_TEST_DOCKER=always, but no Docker"):
        nats_source("always", False, NO_ENGINE)

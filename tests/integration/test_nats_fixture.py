"""The `nats_server` fixture: a missing Docker engine is a reason to use the binary, never an
error, and a `local_nats` test gets a server process it can crash and restart."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import pytest
import testcontainers.core.docker_client

from grove_core import natsserver
from grove_core.log import EventLog
from grove_core.natsserver import LocalNatsCluster, LocalNatsServer, NatsServerError
from tests.conftest import DOCKER_PING_TIMEOUT_S, NatsEndpoint, find_docker_problem, held_port

pytestmark = pytest.mark.integration


def test_an_engine_that_is_not_there_is_a_reason_not_an_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(testcontainers.core.docker_client, "get_docker_host", lambda: None)
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-docker.sock")
    started = time.monotonic()

    problem = find_docker_problem()

    assert time.monotonic() - started < DOCKER_PING_TIMEOUT_S + 1
    assert problem is not None
    assert problem.startswith("no Docker engine answers")


@pytest.mark.local_nats
async def test_a_local_nats_test_can_crash_and_restart_its_server(
    nats_server: NatsEndpoint,
) -> None:
    assert nats_server.server is not None
    nats_server.kill()
    nats_server.restart()

    log = await EventLog.connect(nats_server.url, name="after-restart")
    try:
        await log.ensure_stream()
    finally:
        await log.close()


def choose_first(monkeypatch: pytest.MonkeyPatch, port: int) -> None:
    """Make `natsserver.free_port` answer `port` first (one another process holds, as a test
    beside this one might), and choose freely after that."""
    ports = iter([port])
    real_free_port = natsserver.free_port
    monkeypatch.setattr(
        natsserver,
        "free_port",
        lambda host="127.0.0.1": next(ports, None) or real_free_port(host),
    )


def test_a_chosen_port_taken_before_the_server_binds_it_is_chosen_again(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with held_port() as taken:
        choose_first(monkeypatch, taken)
        server = LocalNatsServer(tmp_path / "nats").start()
        try:
            assert server.port != taken
            assert "address already in use" in (tmp_path / "nats" / "nats-server.log").read_text()
            with urllib.request.urlopen(f"http://127.0.0.1:{server.monitor_port}/healthz") as r:
                assert r.status == 200
        finally:
            server.stop()

        given = LocalNatsServer(tmp_path / "given", port=taken)
        with pytest.raises(NatsServerError, match=f"127.0.0.1:{taken}.*address already in use"):
            given.start()
        assert given.port == taken


def test_a_cluster_chooses_its_route_ports_again_when_one_is_taken(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with held_port() as taken:
        choose_first(monkeypatch, taken)  # the first node's route port
        cluster = LocalNatsCluster(tmp_path / "cluster").start()
        try:
            routes = {arg for node in cluster.nodes for arg in node.extra_args}
            assert f"nats://127.0.0.1:{taken}" not in routes
            said = (tmp_path / "cluster" / "node-0" / "nats-server.log").read_text()
            assert f"127.0.0.1:{taken}: bind: address already in use" in said
            for node in cluster.nodes:
                url = f"http://127.0.0.1:{node.monitor_port}/healthz?js-enabled-only=true"
                with urllib.request.urlopen(url) as r:
                    assert r.status == 200
        finally:
            cluster.stop()


def test_a_cluster_that_cannot_start_leaves_no_node_running(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # How each start of a node ended, with the node (kept, so that no two are confused).
    ends: list[tuple[LocalNatsServer, str]] = []
    real_start_once = LocalNatsServer._start_once

    def recorded_start_once(node: LocalNatsServer, timeout: float) -> LocalNatsServer:
        try:
            started = real_start_once(node, timeout)
        except NatsServerError as exc:
            ends.append((node, str(exc)))
            raise
        ends.append((node, "healthy"))
        return started

    monkeypatch.setattr(LocalNatsServer, "_start_once", recorded_start_once)
    with held_port() as taken:
        routes_chosen = 0
        real_free_port = natsserver.free_port

        def first_route_port_always_taken(host: str | None = None) -> int:
            nonlocal routes_chosen
            if host is not None:  # a node's client or monitoring port
                return real_free_port(host)
            routes_chosen += 1
            return taken if routes_chosen % 3 == 1 else real_free_port()

        monkeypatch.setattr(natsserver, "free_port", first_route_port_always_taken)
        cluster = LocalNatsCluster(tmp_path / "cluster")
        with pytest.raises(NatsServerError, match="address already in use"):
            cluster.start()

    try:
        assert routes_chosen == 3 * natsserver.PORT_ATTEMPTS
        # A node whose route port is taken fails at once: it is not started again with other
        # client and monitoring ports (it is when another process takes one of those, which
        # tests running side by side can do). Starts are counted, not the log's lines: a
        # health check that comes between the failed bind and the exit logs the refusal too.
        refused = f"127.0.0.1:{taken}: bind: address already in use"
        refusals = [index for index, (_, end) in enumerate(ends) if refused in end]
        assert len(refusals) == natsserver.PORT_ATTEMPTS
        for index in refusals:
            refused_node = ends[index][0]
            assert not any(node is refused_node for node, _ in ends[index + 1 :])
        said = (tmp_path / "cluster" / "node-0" / "nats-server.log").read_text()
        assert refused in said
        assert len(cluster.nodes) == 3
        for node in cluster.nodes:
            assert node.process is None or node.process.poll() is not None
    finally:
        cluster.stop()  # what a failing check finds running


def reported_go_max_procs(server: LocalNatsServer) -> int:
    """The Go scheduler slots the running server reports on /varz."""
    with urllib.request.urlopen(f"http://127.0.0.1:{server.monitor_port}/varz") as resp:
        return int(json.load(resp)["gomaxprocs"])


@pytest.mark.parametrize(("cores", "slots"), [(1, 1), (2, 1), (3, 1), (8, 4)])
def test_a_local_server_takes_half_the_cores_for_its_scheduler(
    monkeypatch: pytest.MonkeyPatch, cores: int, slots: int
) -> None:
    monkeypatch.setattr(
        natsserver.os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False
    )

    assert natsserver.shared_go_max_procs() == slots


def test_a_local_server_runs_with_half_the_cores_unless_told_otherwise(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("GOMAXPROCS", raising=False)
    with LocalNatsServer(tmp_path / "shared") as shared:
        assert reported_go_max_procs(shared) == natsserver.shared_go_max_procs()

    other = natsserver.shared_go_max_procs() + 1
    monkeypatch.setenv("GOMAXPROCS", str(other))
    with LocalNatsServer(tmp_path / "from-env") as from_env:
        assert reported_go_max_procs(from_env) == other
    with LocalNatsServer(tmp_path / "given", go_max_procs=other + 1) as given:
        assert reported_go_max_procs(given) == other + 1

    with pytest.raises(ValueError, match="go_max_procs must be at least 1, not 0"):
        LocalNatsServer(tmp_path / "none", go_max_procs=0)

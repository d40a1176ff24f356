"""Request-reply through FastStream (grove_core.rpc) on a real nats-server: refusals and
failures are answered, requests run concurrently, `after_seq` waits for the fold, and each
service's /metrics carries FastStream's NATS middleware metrics for what it serves (the
spawners: their peers' heartbeats)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from nats.aio.client import Client

from agentgrove.client import GroveClient
from grove_core.log import EventLog
from grove_core.rpc import Refusal, RpcServer
from tests.conftest import NatsEndpoint, StackFactory
from tests.integration.test_recovery import metric_total, wait_metric

pytestmark = pytest.mark.integration


async def ask(nc: Client, subject: str, request: Any, timeout: float = 5) -> Any:
    data = request if isinstance(request, bytes) else json.dumps(request).encode()
    reply = await nc.request(subject, data, timeout=timeout)
    return json.loads(reply.data)


@pytest.fixture
async def server(nats_server: NatsEndpoint) -> AsyncIterator[RpcServer]:
    applied = 0

    async def wait_applied(seq: int, wait: float | None) -> None:
        if applied < seq:
            raise Refusal(f"folded to {applied}, not yet {seq} (waited {wait}); retry", "behind")

    async def slow(request: dict[str, Any]) -> dict[str, Any]:
        await asyncio.sleep(float(request.get("seconds", 1.0)))
        return {"slept": request.get("seconds", 1.0)}

    async def fast(request: dict[str, Any]) -> dict[str, Any]:
        return {"echo": request}

    async def broken(request: dict[str, Any]) -> dict[str, Any]:
        raise KeyError("missing")

    async def refuses(request: dict[str, Any]) -> dict[str, Any]:
        raise Refusal("not today", "testing")

    rpc = RpcServer(
        "testsvc",
        {"slow": slow, "fast": fast, "broken": broken, "refuses": refuses},
        wait_applied=wait_applied,
    )
    await rpc.start(nats_server.url)
    try:
        yield rpc
    finally:
        await rpc.close()


async def test_answers_refusals_and_failures(server: RpcServer, event_log: EventLog) -> None:
    nc = event_log.nc
    assert await ask(nc, "grove.rpc.testsvc.fast", {"a": 1}) == {"echo": {"a": 1}}
    assert await ask(nc, "grove.rpc.testsvc.refuses", {}) == {"error": "not today"}
    failed = await ask(nc, "grove.rpc.testsvc.broken", {})
    assert failed == {"error": "the testsvc failed on broken: KeyError('missing'); retry"}
    assert await ask(nc, "grove.rpc.testsvc.fast", b"{not json") == {
        "error": "the request must be JSON"
    }
    assert await ask(nc, "grove.rpc.testsvc.fast", [1, 2]) == {
        "error": "the request must be a JSON object"
    }
    assert await ask(nc, "grove.rpc.testsvc.fast", {"after_seq": "x"}) == {
        "error": "'after_seq' must be a whole number of at least 0"
    }
    assert await ask(nc, "grove.rpc.testsvc.fast", {"after_seq": 5}) == {
        "error": "folded to 0, not yet 5 (waited None); retry"
    }
    assert await ask(nc, "grove.rpc.testsvc.fast", {"after_seq": 5, "after_seq_wait": 2}) == {
        "error": "folded to 0, not yet 5 (waited 2.0); retry"
    }
    assert await ask(nc, "grove.rpc.testsvc.fast", {"after_seq": 5, "after_seq_wait": -1}) == {
        "error": "'after_seq_wait' must be a number of seconds of at least 0"
    }


async def test_a_slow_request_does_not_hold_up_the_others(
    server: RpcServer, event_log: EventLog
) -> None:
    nc = event_log.nc
    started = time.monotonic()
    slow = asyncio.create_task(ask(nc, "grove.rpc.testsvc.slow", {"seconds": 2.0}))
    quick = await asyncio.gather(*(ask(nc, "grove.rpc.testsvc.fast", {"i": i}) for i in range(20)))
    assert [q["echo"]["i"] for q in quick] == list(range(20))
    assert time.monotonic() - started < 2.0, "the fast requests waited for the slow one"
    assert await slow == {"slept": 2.0}
    several = await asyncio.gather(
        *(ask(nc, "grove.rpc.testsvc.slow", {"seconds": 1.0}) for _ in range(5))
    )
    assert len(several) == 5
    assert time.monotonic() - started < 4.5, "slow requests ran one after the other"


async def test_each_service_exports_faststream_metrics_for_its_queries(
    make_stack: StackFactory, nats_server: NatsEndpoint
) -> None:
    stack = await asyncio.to_thread(make_stack)
    async with await GroveClient.connect(nats_server.url) as client:
        await client.resource_status()
        await client.routing.tree()
        await client.artifacts.list()
        refused = await ask(client.log.nc, "grove.rpc.router.summary", {"agent_id": "nobody"})
        assert "no agent 'nobody'" in refused["error"]
    queried = {  # process: (service, a subject it answers)
        "governor": ("governor", "grove.rpc.governor.status"),
        "router": ("router", "grove.rpc.router.tree"),
        "artifacts": ("artifacts", "grove.rpc.artifacts.list"),
        "spawner-1": ("spawner", "grove.rpc.spawner.heartbeat"),  # its own heartbeats
    }
    async with aiohttp.ClientSession() as session, asyncio.timeout(20):
        for process, (name, subject) in queried.items():
            port = stack.services[process].http_port
            await wait_metric(
                session,
                port,
                "faststream_received_processed_messages_total",
                1,
                app_name=name,
                handler=subject,
            )
            duration = await metric_total(
                session,
                port,
                "faststream_received_processed_messages_duration_seconds_count",
                app_name=name,
                handler=subject,
            )
            assert duration >= 1
            verb = subject.rsplit(".", 1)[1]
            assert (
                await metric_total(
                    session, port, "grove_rpc_requests_total", service=name, verb=verb, outcome="ok"
                )
                >= 1
            )
        router_port = stack.services["router"].http_port
        assert (
            await metric_total(
                session,
                router_port,
                "grove_rpc_requests_total",
                service="router",
                verb="summary",
                outcome="refused",
            )
            >= 1
        )

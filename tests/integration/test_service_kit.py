"""The service kit (`grove_core.service.Service`): what its health endpoints say while a
service starts."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from grove_core.log import EventLog
from grove_core.service import Service
from grove_core.settings import ServiceSettings
from tests.conftest import NatsEndpoint
from tests.integration.test_exhaustion import wait_readyz

pytestmark = pytest.mark.integration


async def probe(session: aiohttp.ClientSession, port: int, path: str) -> int:
    async with session.get(f"http://127.0.0.1:{port}/{path}") as response:
        return response.status


async def test_a_service_is_not_ready_before_its_setup_has_registered_its_checks(
    nats_server: NatsEndpoint, event_log: EventLog
) -> None:
    # The endpoints answer from before `setup` runs; its ready checks (the projection caught
    # up, the RPC served) come later, after awaits of its own (the artifact-store makes its
    # bucket first). In between, /readyz must not say ready.
    service = Service("kit", ServiceSettings(nats_url=nats_server.url, http_port=0))
    in_setup = asyncio.Event()
    go_on = asyncio.Event()

    async def setup(svc: Service) -> None:
        in_setup.set()
        await go_on.wait()
        svc.ready_checks.append(lambda: True)

    running = asyncio.create_task(service.run(setup))
    try:
        async with asyncio.timeout(20), aiohttp.ClientSession() as session:
            await in_setup.wait()
            assert await probe(session, service.http_port, "healthz") == 200
            assert await probe(session, service.http_port, "readyz") == 503

            go_on.set()
            await wait_readyz(service.http_port, 200)
    finally:
        service.stop_event.set()
        assert await asyncio.wait_for(running, 20) == 0

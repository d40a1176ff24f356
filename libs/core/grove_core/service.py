"""The service kit: connect to the log, serve health and metrics, run until told to stop."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import uvloop
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from grove_core import collector
from grove_core.catchup import CatchUpHelper
from grove_core.log import EventLog
from grove_core.rpc import RpcServer
from grove_core.settings import ServiceSettings
from grove_core.tasks import cancel_and_wait

log = logging.getLogger(__name__)

ReadyCheck = Callable[[], bool]
Setup = Callable[["Service"], Coroutine[Any, Any, None]]


def nats_options(settings: ServiceSettings) -> dict[str, Any]:
    """Connection options (credentials, TLS) from the settings."""
    return settings.nats_access().options()


class Service:
    """One AgentGrove service process: its log connection, HTTP endpoints and tasks."""

    def __init__(self, name: str, settings: ServiceSettings) -> None:
        self.name = name
        self.settings = settings
        self.stop_event = asyncio.Event()
        self.ready_checks: list[ReadyCheck] = []
        #: Whether `setup` has returned: the HTTP endpoints answer before it has, while its
        #: ready checks are not all registered yet.
        self.set_up = False
        self.log: EventLog | None = None
        self.http_port = 0
        self._tasks: list[asyncio.Task[Any]] = []
        #: Called, in order, when the service is told to stop, before its tasks are cancelled.
        self.on_stop: list[Callable[[], Awaitable[None]]] = []

    async def connect(self) -> EventLog:
        """Connect to NATS and bind to the stream."""
        self.log = await EventLog.connect(
            self.settings.nats_url,
            name=self.name,
            **nats_options(self.settings),
        )
        self.log.acks.batch_from = self.settings.append_batch_from
        if self.settings.catch_up_helper_min > 0:
            self.log.helper = CatchUpHelper(
                self.settings.nats_access(), self.settings.catch_up_helper_min
            )
        await self.log.wait_for_stream()
        return self.log

    async def serve_rpc(self, server: RpcServer) -> None:
        """Answer the server's verbs (through its own connection, with this service's
        credentials) until the service stops."""
        await server.start(self.settings.nats_url, **nats_options(self.settings))
        self.on_stop.append(server.close)

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Run a task for the life of the service; if it dies, the service stops (and exits 1)."""
        task = asyncio.create_task(coro, name=name)

        def done(t: asyncio.Task[Any]) -> None:
            if t.cancelled():
                return
            exc = t.exception()
            if exc is not None:
                log.error("%s: task %s failed: %r", self.name, name, exc, exc_info=exc)
                self.failed = True
                self.stop_event.set()

        task.add_done_callback(done)
        self._tasks.append(task)
        return task

    failed = False

    def ready(self) -> bool:
        """Set up, connected, and every ready check passes (caught up, serving requests)."""
        if not self.set_up:
            return False
        connected = self.log is not None and self.log.nc.is_connected
        return connected and all(check() for check in self.ready_checks)

    async def _serve_http(self) -> web.AppRunner:
        async def healthz(_: web.Request) -> web.Response:
            ok = self.log is not None and not self.log.nc.is_closed
            body = {"ok": ok, "service": self.name, "pid": os.getpid()}
            return web.json_response(body, status=200 if ok else 503)

        async def readyz(_: web.Request) -> web.Response:
            ok = self.ready()
            body = {"ready": ok, "service": self.name, "pid": os.getpid()}
            return web.json_response(body, status=200 if ok else 503)

        async def metrics(_: web.Request) -> web.Response:
            return web.Response(
                body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST}
            )

        app = web.Application()
        app.router.add_get("/healthz", healthz)
        app.router.add_get("/readyz", readyz)
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.settings.http_host, self.settings.http_port)
        await site.start()
        server = site._server
        sockets = getattr(server, "sockets", None) or []
        self.http_port = sockets[0].getsockname()[1] if sockets else self.settings.http_port
        log.info(
            "%s: health and metrics on http://%s:%s",
            self.name,
            self.settings.http_host,
            self.http_port,
        )
        return runner

    async def run(self, setup: Setup) -> int:
        """Connect, let `setup` start the service's tasks, serve until SIGTERM/SIGINT."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop_event.set)
        await self.connect()
        runner = await self._serve_http()
        try:
            setup_task = asyncio.create_task(setup(self))
            stopped = asyncio.create_task(self.stop_event.wait())
            await asyncio.wait({setup_task, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if not setup_task.done():
                setup_task.cancel()
            elif setup_task.exception() is not None:
                raise setup_task.exception()  # type: ignore[misc]
            else:
                self.set_up = True
                collector.started()
            await self.stop_event.wait()
        finally:
            for hook in self.on_stop:
                try:
                    await hook()
                except Exception:
                    log.exception("%s: stop hook failed", self.name)
            for task in self._tasks:
                task.cancel()
            for task in self._tasks:
                await cancel_and_wait(task)
            await runner.cleanup()
            if self.log is not None:
                await self.log.close()
        return 1 if self.failed else 0


def run_service(name: str, setup: Setup, settings: ServiceSettings) -> None:
    """Entry point of `python -m grove_<name>`: logging, event loop, exit code."""
    logging.basicConfig(
        level=settings.log_level.upper(),
        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s",
    )
    uvloop.install()
    collector.manage()
    service = Service(name, settings)
    try:
        code = asyncio.run(service.run(setup))
    except Exception:
        log.exception("%s stopped on an error", name)
        code = 1
    sys.exit(code)

"""Create or update the GROVE stream: the set-up step that runs before the services.

Connects with the same GROVE_ settings as a service (URL, user and password, creds file, TLS
CA) and applies the stream definition of the events library. GROVE_STREAM_REPLICAS (default
1) sets how many JetStream servers keep a copy; a cluster of three takes 3. The services never
create the stream, they wait for it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import sys
from collections.abc import Mapping

import nats.errors
from nats.js import api as js_api

from grove_core.log import EventLog, LogError
from grove_core.service import nats_options
from grove_core.settings import ServiceSettings
from grove_events import GROVE_STREAM, StreamDefinition

log = logging.getLogger("grove.setup")


def definition_from_env(env: Mapping[str, str] | None = None) -> StreamDefinition:
    """The stream definition, with the replica count (and optional size limit) from `env`."""
    env = os.environ if env is None else env
    replicas = int(env.get("GROVE_STREAM_REPLICAS", "1"))
    if not 1 <= replicas <= 5:
        raise ValueError(f"GROVE_STREAM_REPLICAS must be between 1 and 5, not {replicas}")
    max_bytes = int(env.get("GROVE_STREAM_MAX_BYTES", str(GROVE_STREAM.max_bytes)))
    return dataclasses.replace(GROVE_STREAM, replicas=replicas, max_bytes=max_bytes)


async def _report(exc: Exception) -> None:
    log.warning("NATS: %s", exc)


async def _connect(settings: ServiceSettings, definition: StreamDefinition) -> EventLog | str:
    try:
        return await EventLog.connect(
            settings.nats_url,
            name="grove-setup",
            definition=definition,
            allow_reconnect=False,
            # Fail this attempt instead of retrying inside the client; the loop retries.
            max_reconnect_attempts=1,
            error_cb=_report,
            **nats_options(settings),
        )
    except LogError as exc:
        return str(exc)


async def _ensure(event_log: EventLog) -> js_api.StreamInfo | str:
    try:
        return await event_log.ensure_stream()
    except (nats.errors.Error, TimeoutError) as exc:
        # A fresh cluster answers "no suitable peers" until its meta leader is elected.
        return f"{exc.__class__.__name__}: {exc}"


async def setup(timeout: float) -> int:
    """Connect and ensure the stream, retrying until `timeout` seconds; 0 on success."""
    settings = ServiceSettings()
    definition = definition_from_env()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while isinstance(connected := await _connect(settings, definition), str):
        if loop.time() > deadline:
            log.error("%s", connected)
            return 1
        log.info("waiting for NATS: %s", connected)
        await asyncio.sleep(2.0)
    event_log = connected
    try:
        while isinstance(info := await _ensure(event_log), str):
            if loop.time() > deadline:
                log.error("cannot create stream %s: %s", definition.name, info)
                return 1
            log.info("stream %s not ready yet: %s", definition.name, info)
            await asyncio.sleep(2.0)
    finally:
        await event_log.close()
    log.info(
        "stream %s ready: subjects %s, replicas %s, %s messages",
        info.config.name,
        ", ".join(info.config.subjects or []),
        info.config.num_replicas,
        info.state.messages,
    )
    return 0


def main() -> None:
    """Entry point: `python setup_stream.py`."""
    logging.basicConfig(
        level=os.environ.get("GROVE_LOG_LEVEL", "INFO").upper(),
        format="%(asctime)s setup %(levelname)s: %(message)s",
    )
    timeout = float(os.environ.get("GROVE_SETUP_TIMEOUT", "120"))
    sys.exit(asyncio.run(setup(timeout)))


if __name__ == "__main__":
    main()

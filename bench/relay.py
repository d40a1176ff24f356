"""A raw relay in its own process: `python -m bench.relay URL SOURCE [TARGET]`.

It reads SOURCE with an ordered consumer and publishes each message again to TARGET, as the
in-process relay of `raw.two_hop` does, but from another process, as each AgentGrove service
is. Without TARGET it only reads (a listener: a process that is woken by every message but
answers none, as the services that fold an event they do not act on). It says `ready` on
standard output once it listens and stops when its standard input closes, so it never
outlives the benchmark that started it.
"""

from __future__ import annotations

import asyncio
import sys

import nats
import uvloop
from nats.aio.msg import Msg
from nats.js import api as js_api

from bench.raw import forwarder

#: What a relay prints once its consumer listens.
READY = b"ready\n"


async def relay(url: str, source: str, target: str | None) -> None:
    """Forward `source` to `target` (or only read it) until standard input closes."""
    nc = await nats.connect(url, name=f"bench-relay-{source}")
    sub = await nc.jetstream().subscribe(
        source,
        cb=_listen if target is None else forwarder(nc, target),
        ordered_consumer=True,
        deliver_policy=js_api.DeliverPolicy.NEW,
    )
    loop = asyncio.get_running_loop()
    closed = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(closed), sys.stdin.buffer)
    sys.stdout.buffer.write(READY)
    sys.stdout.buffer.flush()
    try:
        await closed.read()  # until the benchmark closes our input
    finally:
        await sub.unsubscribe()
        await nc.close()


async def _listen(msg: Msg) -> None:
    """A listener's callback: the message was delivered and read; nothing more."""


def main() -> None:
    """Entry point of a relay process."""
    if len(sys.argv) not in (3, 4):
        print("usage: python -m bench.relay URL SOURCE [TARGET]", file=sys.stderr)
        sys.exit(2)
    url, source, *target = sys.argv[1:]
    uvloop.run(relay(url, source, target[0] if target else None))


if __name__ == "__main__":
    main()

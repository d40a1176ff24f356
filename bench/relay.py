"""A raw relay in its own process: `python -m bench.relay URL SOURCE TARGET`.

It reads SOURCE with an ordered consumer and publishes each message again to TARGET, as the
in-process relay of `raw.two_hop` does, but from another process, as each AgentGrove service
is. It says `ready` on standard output once it listens and stops when its standard input
closes, so it never outlives the benchmark that started it.
"""

from __future__ import annotations

import asyncio
import sys

import nats
import uvloop
from nats.aio.msg import Msg
from nats.js import api as js_api

from bench.raw import MSG_ID

#: What a relay prints once its consumer listens.
READY = b"ready\n"


async def relay(url: str, source: str, target: str) -> None:
    """Forward `source` to `target` until standard input closes."""
    nc = await nats.connect(url, name=f"bench-relay-{source}")
    js = nc.jetstream()

    async def forward(msg: Msg) -> None:
        key = (msg.headers or {}).get(MSG_ID, "")
        await js.publish(target, msg.data, headers={MSG_ID: f"{key}-{target}"})

    sub = await js.subscribe(
        source, cb=forward, ordered_consumer=True, deliver_policy=js_api.DeliverPolicy.NEW
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


def main() -> None:
    """Entry point of a relay process."""
    if len(sys.argv) != 4:
        print("usage: python -m bench.relay URL SOURCE TARGET", file=sys.stderr)
        sys.exit(2)
    uvloop.run(relay(*sys.argv[1:]))


if __name__ == "__main__":
    main()

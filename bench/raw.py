"""Raw nats-py baselines: what the same nats-server does for a client that does nothing else.

Each figure is what AgentGrove's own figure is compared with: one awaited JetStream publish,
a two-hop publish → consumer → publish → consumer round trip (the shape of spawn → admitted →
started), pipelined `publish_async` throughput, and ordered-consumer replay throughput.

The two-hop's relay runs in the benchmark's own process. Two more round trips put each relay in
a process of its own (`bench.relay`), as AgentGrove's services are: a two-hop, and a three-hop
through two relays, which has spawn → started's own shape (three appends, three deliveries,
three processes), alone and with three more processes that read every message of the chain
without answering (as AgentGrove's other services read every event). They show what crossing
processes costs on the machine; the goals keep the in-process two-hop as their baseline.
"""

from __future__ import annotations

import asyncio
import itertools
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import api as js_api

from bench.stats import latency_summary, rate

STREAM = "BENCH"
#: About the size of a spawn event as AgentGrove encodes it.
PAYLOAD = b'{"pad":"' + b"x" * 290 + b'"}'
MSG_ID = js_api.Header.MSG_ID.value
#: Seconds a single measured message may take before the run counts as failed.
PER_MESSAGE_TIMEOUT_S = 30.0


async def ensure_stream(nc: NatsClient) -> None:
    """The BENCH stream (file storage, like GROVE), fresh."""
    js = nc.jetstream()
    config = js_api.StreamConfig(
        name=STREAM,
        subjects=["bench.>"],
        storage=js_api.StorageType.FILE,
        duplicate_window=120.0,
    )
    await js.add_stream(config)


async def awaited_publish(nc: NatsClient, count: int, warmup: int = 20) -> dict[str, Any]:
    """Latency of one awaited JetStream publish (with a Nats-Msg-Id, as EventLog.append)."""
    js = nc.jetstream()
    samples: list[float] = []
    for index in range(warmup + count):
        started = time.perf_counter()
        await js.publish("bench.pub", PAYLOAD, headers={MSG_ID: f"pub-{index}"})
        if index >= warmup:
            samples.append(time.perf_counter() - started)
    return latency_summary(samples)


async def two_hop(
    relay: NatsClient, client: NatsClient, count: int, warmup: int = 20
) -> dict[str, Any]:
    """Round trip: the client publishes, a relay's consumer receives and publishes again, the
    client's consumer receives. Relay and client have their own connections, in this process."""
    hop1 = await relay.jetstream().subscribe(
        "bench.hop1",
        cb=forwarder(relay, "bench.hop2"),
        ordered_consumer=True,
        deliver_policy=js_api.DeliverPolicy.NEW,
    )
    try:
        return await _round_trips(client, "bench.hop1", "bench.hop2", count, warmup)
    finally:
        await hop1.unsubscribe()


def forwarder(nc: NatsClient, target: str) -> Callable[[Msg], Awaitable[None]]:
    """A consumer callback that publishes each message again to `target` and waits for its
    acknowledgement: a relay's whole work."""
    js = nc.jetstream()

    async def forward(msg: Msg) -> None:
        key = (msg.headers or {}).get(MSG_ID, "")
        await js.publish(target, msg.data, headers={MSG_ID: f"{key}-{target}"})

    return forward


async def relayed_round_trip(
    client: NatsClient,
    url: str,
    relays: int,
    count: int,
    *,
    warmup: int = 20,
    listeners: int = 0,
) -> dict[str, Any]:
    """Round trip through `relays` relay processes in a chain: the client publishes to the
    first, each relay's consumer receives and publishes to the next subject, and the client's
    consumer receives from the last relay. `relays + 1` appends and deliveries in all.

    With `listeners`, that many more processes read every message of the chain and answer
    none, as the services that fold each event without acting on it."""
    subjects = [f"bench.chain{relays}x{listeners}.{step}" for step in range(relays + 1)]
    processes: list[asyncio.subprocess.Process] = []
    try:
        for source, target in itertools.pairwise(subjects):
            processes.append(await _relay_process(url, source, target))
        for _ in range(listeners):
            processes.append(await _relay_process(url, f"bench.chain{relays}x{listeners}.*"))
        return await _round_trips(client, subjects[0], subjects[-1], count, warmup)
    finally:
        for process in processes:
            if process.stdin is not None:
                process.stdin.close()  # a relay stops when its input closes
        for process in processes:
            try:
                await asyncio.wait_for(process.wait(), 10.0)
            except TimeoutError:
                process.kill()
                await process.wait()


async def _relay_process(
    url: str, source: str, target: str | None = None
) -> asyncio.subprocess.Process:
    """A `bench.relay` process (a listener without `target`), once its consumer listens."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "bench.relay",
        url,
        source,
        *([target] if target else []),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert process.stdout is not None
    try:
        ready = await asyncio.wait_for(process.stdout.readline(), PER_MESSAGE_TIMEOUT_S)
    except TimeoutError:
        ready = b""
    if not ready:
        process.kill()
        await process.wait()
        raise RuntimeError(f"relay {source} → {target or '(listener)'} did not start listening")
    return process


async def _round_trips(
    client: NatsClient, first: str, last: str, count: int, warmup: int
) -> dict[str, Any]:
    """Latency of publishing to `first` until the message comes back on `last`, one at a time."""
    js = client.jetstream()
    arrived = asyncio.Queue[float]()

    async def back(msg: Msg) -> None:
        arrived.put_nowait(time.perf_counter())

    sub = await js.subscribe(
        last, cb=back, ordered_consumer=True, deliver_policy=js_api.DeliverPolicy.NEW
    )
    samples: list[float] = []
    try:
        for index in range(warmup + count):
            started = time.perf_counter()
            await js.publish(first, PAYLOAD, headers={MSG_ID: f"{first}-{index}"})
            done = await asyncio.wait_for(arrived.get(), PER_MESSAGE_TIMEOUT_S)
            if index >= warmup:
                samples.append(done - started)
    finally:
        await sub.unsubscribe()
    return latency_summary(samples)


async def pipelined_publish(nc: NatsClient, count: int, window: int = 2000) -> dict[str, Any]:
    """Throughput of `publish_async`, `window` acknowledgements outstanding at most."""
    js = nc.jetstream()
    started = time.perf_counter()
    pending: list[asyncio.Future[Any]] = []
    for index in range(count):
        pending.append(
            await js.publish_async("bench.async", PAYLOAD, headers={MSG_ID: f"async-{index}"})
        )
        if len(pending) >= window:
            await asyncio.wait_for(asyncio.gather(*pending), PER_MESSAGE_TIMEOUT_S)
            pending.clear()
    await asyncio.wait_for(asyncio.gather(*pending), PER_MESSAGE_TIMEOUT_S)
    elapsed = time.perf_counter() - started
    return {"msgs_per_s": rate(count, elapsed), "count": count, "seconds": round(elapsed, 3)}


async def ordered_replay(
    nc: NatsClient, stream: str, subject: str, last_seq: int, timeout: float = 600.0
) -> dict[str, Any]:
    """Throughput of an ordered push consumer reading `stream` from sequence 1 to `last_seq`,
    counting the messages and nothing else."""
    js = nc.jetstream()
    done = asyncio.Event()
    seen = 0

    async def count(msg: Msg) -> None:
        nonlocal seen
        seen += 1
        if msg.metadata.sequence.stream >= last_seq:
            done.set()

    started = time.perf_counter()
    sub = await js.subscribe(
        subject,
        cb=count,
        stream=stream,
        ordered_consumer=True,
        deliver_policy=js_api.DeliverPolicy.ALL,
        pending_msgs_limit=-1,
        pending_bytes_limit=-1,
    )
    try:
        await asyncio.wait_for(done.wait(), timeout)
    finally:
        await sub.unsubscribe()
    elapsed = time.perf_counter() - started
    return {"msgs_per_s": rate(seen, elapsed), "count": seen, "seconds": round(elapsed, 3)}

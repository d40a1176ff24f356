"""Appends sent as atomic batches (`AckInbox.batch_from`), against a real nats-server: each
append is answered as if it had gone alone (its own sequence, in order; a copy said to be one;
a lost guard failing only its own append), and a stream that takes no batches gets the appends
one by one."""

from __future__ import annotations

import asyncio
from collections import Counter
from types import SimpleNamespace
from typing import Any, cast

import nats.errors
import nats.js.errors
import pytest
from nats.aio.client import ServerVersion
from nats.aio.msg import Msg
from nats.js import api as js_api

from agentgrove.client import GroveClient
from grove_core.acks import AckInbox, server_takes_batches, stored
from grove_core.log import ConcurrencyConflict, EventLog
from grove_events import subject_for
from tests.conftest import NatsEndpoint
from tests.integration.test_acks import assert_stored_as_answered
from tests.integration.test_lifecycle import (
    StackFactory,
    history,
    metric,
    per_agent,
    python_agent,
    statuses,
    terminates,
    wait_ended,
)
from tests.integration.test_log import spawn_event, status_event

pytestmark = pytest.mark.integration

#: Agents spawned at once through a stack, all admitted at once.
BURST = 120
ROOMY = f"""
resources:
  global:
    max_concurrent_agents: {BURST}
"""


async def test_appends_in_flight_go_out_in_batches_each_answered_for_itself(
    event_log: EventLog,
) -> None:
    event_log.acks.batch_from = 4
    events = [spawn_event(f"agent-{i}") for i in range(300)]
    landed = await event_log.append_many(events)
    assert event_log.acks.batches > 0
    await assert_stored_as_answered(event_log, events, landed, every=25)

    # A batch holding a copy of a stored event is refused whole; each is then sent alone.
    batches = event_log.acks.batches
    event_log.acks.batch_from = 1  # the first goes alone, the other three in a batch
    mixed = [events[0], spawn_event("new-1"), events[1], spawn_event("new-2")]
    again = await asyncio.gather(*(event_log.append(event) for event in mixed))
    assert [(a.seq, a.duplicate) for a in again] == [
        (1, True),
        (301, False),
        (2, True),
        (302, False),
    ]
    assert event_log.acks.batches == batches
    assert event_log.acks.refused_batches == 1


async def test_a_lost_guard_in_a_batch_fails_only_its_own_append(event_log: EventLog) -> None:
    event_log.acks.batch_from = 1
    await event_log.append(spawn_event("a"))
    admitted = await event_log.append(status_event("a", "admitted"), expect_last_seq=0)
    outcomes = await asyncio.gather(
        event_log.append(spawn_event("first")),  # alone: nothing unanswered yet
        event_log.append(spawn_event("b")),
        event_log.append(status_event("a", "started"), expect_last_seq=admitted.seq - 1),
        event_log.append(spawn_event("c")),
        return_exceptions=True,
    )
    assert isinstance(outcomes[2], ConcurrencyConflict)
    stored = [o for o in outcomes if not isinstance(o, BaseException)]
    assert sorted(a.seq for a in stored) == [3, 4, 5]
    assert (event_log.acks.batches, event_log.acks.refused_batches) == (0, 1)
    for agent in ("b", "c"):
        assert await event_log.get_last(subject_for("spawn", agent)) is not None
    assert await event_log.get_last(subject_for("status", "a")) is not None

    racing = await asyncio.gather(
        *(
            event_log.append(status_event("a", "started"), expect_last_seq=admitted.seq)
            for _ in range(5)
        ),
        return_exceptions=True,
    )
    assert sum(not isinstance(o, BaseException) for o in racing) == 1
    assert sum(isinstance(o, ConcurrencyConflict) for o in racing) == 4


async def test_a_batch_nobody_answers_fails_each_of_its_appends_in_time(
    event_log: EventLog,
) -> None:
    """A plain subscriber takes the messages and answers none: every append of the batch,
    as the one sent alone before it, fails with nats-py's timeout; the inbox then goes on."""
    held: list[Msg] = []

    async def hold(msg: Msg) -> None:
        held.append(msg)

    sub = await event_log.nc.subscribe("silent.>", cb=hold)
    acks = AckInbox(event_log.nc, timeout=0.3, batch_from=1)
    try:
        outcomes = await asyncio.gather(
            *(acks.publish(f"silent.{i}", b"{}", {}) for i in range(4)), return_exceptions=True
        )
        assert all(isinstance(o, nats.errors.TimeoutError) for o in outcomes), outcomes
        assert len(held) == 4
        assert held[-1].headers is not None
        assert held[-1].headers.get("Nats-Batch-Commit") == "1"
        assert (acks.batches, acks.refused_batches) == (0, 0)
        event = spawn_event("after")
        seq, _ = await acks.publish(
            subject_for("spawn", "after"), event.model_dump_json().encode(), {}
        )
        assert seq == 1
    finally:
        await sub.unsubscribe()


async def test_appends_queued_for_a_batch_fail_when_the_connection_closes(
    nats_server: NatsEndpoint,
) -> None:
    log = await EventLog.connect(nats_server.url, name="batches-closing")
    acks = AckInbox(log.nc, timeout=5, batch_from=1)
    await acks.send("silent.first", b"{}", {})  # unanswered: the next ones queue
    await log.nc.close()
    outcomes = await asyncio.gather(
        *(acks.publish(f"silent.{i}", b"{}", {}) for i in range(3)), return_exceptions=True
    )
    assert all(isinstance(o, nats.errors.ConnectionClosedError) for o in outcomes), outcomes


async def test_a_stream_without_atomic_batches_takes_the_appends_alone(
    event_log: EventLog,
) -> None:
    info = await event_log.js.stream_info(event_log.stream)
    config = cast(js_api.StreamConfig, info.config)
    config.allow_atomic = False
    await event_log.js.update_stream(config)
    event_log.acks.batch_from = 2
    landed = await event_log.append_many([spawn_event(f"agent-{i}") for i in range(100)])
    assert [a.seq for a in landed] == list(range(1, 101))
    assert event_log.acks.batch_from == 0  # it stopped trying after the first refusal
    assert (event_log.acks.batches, event_log.acks.refused_batches) == (0, 1)


async def test_services_that_batch_their_appends_run_every_agent_once(
    make_stack: StackFactory, event_log: EventLog
) -> None:
    """A burst through the four services, each sending its appends in batches as soon as one
    is unanswered: every agent is admitted, started and ended exactly once."""
    stack = await asyncio.to_thread(
        make_stack, spawners=2, config=ROOMY, GROVE_APPEND_BATCH_FROM="1"
    )
    client = GroveClient(event_log)
    agents = await asyncio.gather(
        *(client.spawn("go", python_agent("quick")) for _ in range(BURST))
    )

    ended = await wait_ended(event_log, agents, timeout=90)
    assert {e.reason for e in ended.values()} == {"completed"}
    records = await history(event_log)
    once = Counter(dict.fromkeys(agents, 1))
    for status_type in ("admitted", "started", "completed"):
        assert per_agent(statuses(records, status_type)) == once, status_type
    assert per_agent(terminates(records)) == once
    stored = {
        name: await asyncio.to_thread(
            metric, service.http_port, 'grove_append_batches_total{outcome="stored"}'
        )
        for name, service in stack.services.items()
    }
    assert (stored["governor"] or 0) > 0, stored
    assert sum(stored.get(f"spawner-{i}") or 0 for i in (1, 2)) > 0, stored


async def test_a_client_sends_a_burst_of_spawns_in_batches_when_told(
    nats_server: NatsEndpoint, event_log: EventLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GROVE_APPEND_BATCH_FROM", "2")
    async with await GroveClient.connect(nats_server.url) as client:
        agents = await asyncio.gather(
            *(client.spawn("go", python_agent("quick")) for _ in range(60))
        )
        assert client.log.acks.batches > 0
    records = await history(event_log)
    assert sorted(r.event.agent_id for r in records) == sorted(agents)

    monkeypatch.setenv("GROVE_APPEND_BATCH_FROM", "many")
    with pytest.raises(ValueError, match="GROVE_APPEND_BATCH_FROM must be a count"):
        await GroveClient.connect(nats_server.url)
    async with await GroveClient.connect(nats_server.url, append_batch_from=0) as client:
        assert client.log.acks.batch_from == 0


async def test_a_server_that_takes_no_batch_of_such_appends_gets_them_alone(
    event_log: EventLog,
) -> None:
    # nats-server 2.12.0 refused any batch holding `Nats-Msg-Id` (err 10177), which every
    # append carries; later ones still refuse other headers, as this one.
    inbox = event_log.acks
    inbox.batch_from = 1
    guarded = {"Nats-Expected-Last-Msg-Id": "none-before"}
    answers = await asyncio.gather(
        *(
            inbox.send(
                subject_for("spawn", f"agent-{i}"), b"{}", {"Nats-Msg-Id": f"m-{i}", **guarded}
            )
            for i in range(6)
        )
    )
    # Each was answered alone: the stream holds no message, so each guard lost.
    for answer in await asyncio.gather(*answers):
        with pytest.raises(nats.js.errors.APIError, match="wrong last msg ID"):
            stored(answer)
    assert inbox.batch_from == 0  # it stopped trying after the first refusal
    assert (inbox.batches, inbox.refused_batches) == (0, 1)
    info = await event_log.js.stream_info(event_log.stream)
    assert info.state.messages == 0


def test_only_servers_of_2_12_1_and_later_take_batches() -> None:
    def client(version: str) -> Any:
        return SimpleNamespace(connected_server_version=ServerVersion(version))

    assert server_takes_batches(client("2.15.1"))
    assert server_takes_batches(client("2.12.1"))
    assert not server_takes_batches(client("2.12.0"))  # no `Nats-Msg-Id` in a batch
    assert not server_takes_batches(client("2.11.9"))
    assert not server_takes_batches(client("garbage"))
    assert not server_takes_batches(client("0.0.0-unknown"))  # nats-py: not connected

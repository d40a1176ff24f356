"""The services' contracts (their AsyncAPI documents) say what the running services do: every
request-reply subject a contract names is answered, and spawners do send heartbeats."""

from __future__ import annotations

import asyncio
import json

import pytest

from grove_artifacts.contract import CONTRACT as ARTIFACTS
from grove_core.asyncapi import Contract
from grove_core.log import EventLog
from grove_governor.contract import CONTRACT as GOVERNOR
from grove_router.contract import CONTRACT as ROUTER
from grove_spawner.contract import CONTRACT as SPAWNER
from grove_spawner.service import HEARTBEAT_SUBJECT
from tests.conftest import StackFactory

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

ANSWERING: tuple[Contract, ...] = (GOVERNOR, ROUTER, ARTIFACTS)


async def test_every_request_subject_of_a_contract_is_answered(
    make_stack: StackFactory, event_log: EventLog
) -> None:
    await asyncio.to_thread(make_stack)
    subjects = [c.subject for contract in ANSWERING for c in contract.answers]
    assert len(subjects) >= 8
    for subject in subjects:
        reply = await event_log.nc.request(subject, b"{}", timeout=10)
        assert isinstance(json.loads(reply.data), dict), subject


async def test_spawners_send_the_heartbeats_their_contract_describes(
    make_stack: StackFactory, event_log: EventLog
) -> None:
    assert [c.subject for c in SPAWNER.answers] == [HEARTBEAT_SUBJECT]
    await asyncio.to_thread(make_stack)
    sub = await event_log.nc.subscribe(HEARTBEAT_SUBJECT)
    beat = json.loads((await sub.next_msg(timeout=10)).data)
    await sub.unsubscribe()
    assert beat["spawner_id"] == "spawner-1"
    assert isinstance(beat["agents"], list)

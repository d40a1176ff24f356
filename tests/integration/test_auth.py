"""`grove up --auth`: the local stack with the per-service users and permissions of deploy/."""

from __future__ import annotations

import asyncio
import json
import stat
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentgrove.client import GroveClient, build_config
from agentgrove.stack import Stack, StackError
from grove_core.auth import accounts_conf, redact
from grove_core.log import EventLog, LogError
from tests.integration.test_cli import grove

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

ROOT = Path(__file__).resolve().parents[2]


def test_the_shipped_permissions_are_the_deployed_ones() -> None:
    assert accounts_conf() == (ROOT / "deploy" / "nats" / "accounts.conf").read_text()


def test_a_printed_url_hides_the_password() -> None:
    assert redact("nats://producer:s3cret@127.0.0.1:4222") == "nats://producer:***@127.0.0.1:4222"
    assert redact("nats://127.0.0.1:4222") == "nats://127.0.0.1:4222"


@pytest.fixture
def secured_stack(tmp_path: Path) -> Iterator[Stack]:
    stack = Stack(tmp_path / "grove", auth=True, extra_env={"PYTHONPATH": str(ROOT)})
    try:
        yield stack.start()
    finally:
        stack.stop()


async def test_services_and_callers_work_under_their_own_users(secured_stack: Stack) -> None:
    url_file = secured_stack.data_dir / "nats.url"
    assert stat.S_IMODE(url_file.stat().st_mode) == 0o600
    assert url_file.read_text().strip() == secured_stack.caller_url
    passwords = secured_stack.data_dir / "auth" / "passwords.json"
    assert stat.S_IMODE(passwords.stat().st_mode) == 0o600

    async with await GroveClient.connect(secured_stack.caller_url) as client:
        agent = await client.spawn("two words", build_config("command", command=["wc", "-w"]))
        result = await client.wait(agent, timeout=30)
        assert result.reason == "completed"
        assert result.summary.strip() == "2"

        denied: list[str] = []

        async def on_error(exc: Exception) -> None:
            denied.append(str(exc))

        producer = await EventLog.connect(secured_stack.caller_url, error_cb=on_error)
        try:
            await producer.nc.publish(f"grove.terminate.{agent}", b"{}")
            await producer.nc.flush()
            for _ in range(100):
                if denied:
                    break
                await asyncio.sleep(0.05)
        finally:
            await producer.close()
        assert denied, "a producer published a terminate"
        assert "permissions violation" in denied[0].lower()

    with pytest.raises(LogError):
        await EventLog.connect(secured_stack.url, allow_reconnect=False, reachable_within=2)


async def test_an_agent_process_connects_as_the_producer_never_as_the_spawner(
    secured_stack: Stack,
) -> None:
    probe = [sys.executable, "-c", "from tests.agents import probe_credentials_main as m; m()"]
    async with await GroveClient.connect(secured_stack.caller_url) as client:
        agent = await client.spawn("probe", build_config("command", command=probe))
        result = await client.wait(agent, timeout=60)
    assert result.reason == "completed", result.error
    assert json.loads(result.summary) == {
        "user": "producer",
        "url_has_user": False,
        "terminate_denied": True,
        "request_allowed": True,
    }


def test_the_cli_finds_the_secured_stack_through_its_data_folder(secured_stack: Stack) -> None:
    result = grove(None, "--data-dir", str(secured_stack.data_dir), "status")
    assert result.returncode == 0, result.stderr
    assert "agents running: 0" in result.stdout


def test_auth_needs_the_stack_s_own_server(tmp_path: Path) -> None:
    stack = Stack(tmp_path / "grove", auth=True, nats_url="nats://127.0.0.1:4222")
    with pytest.raises(StackError, match="GROVE_NATS_USER"):
        stack.start()

"""`grove up --auth`: the local stack with the per-service users and permissions of deploy/."""

from __future__ import annotations

import asyncio
import json
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats.errors
import pytest

from agentgrove.artifacts import ArtifactError, Artifacts
from agentgrove.client import GroveClient, build_config, credentials_from_env
from agentgrove.stack import Stack, StackError
from grove_core.auth import PRODUCER_INBOX_PREFIX, USERS, LocalAuth, accounts_conf, redact
from grove_core.log import EventLog, LogError
from grove_events import HitlEvent, new_id
from tests.integration.test_cli import grove

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

ROOT = Path(__file__).resolve().parents[2]
#: The stream of the artifact-store's object store bucket (grove_artifacts.blobs.BUCKET).
OBJECT_STREAM = "OBJ_grove-artifacts"


def test_the_shipped_permissions_are_the_deployed_ones() -> None:
    assert accounts_conf() == (ROOT / "deploy" / "nats" / "accounts.conf").read_text()


def test_a_printed_url_hides_the_password() -> None:
    assert redact("nats://producer:s3cret@127.0.0.1:4222") == "nats://producer:***@127.0.0.1:4222"
    assert redact("nats://127.0.0.1:4222") == "nats://127.0.0.1:4222"


def test_a_data_folder_made_before_some_users_existed_gets_them(tmp_path: Path) -> None:
    old = {user: f"p-old-{user}" for user in USERS if user not in ("caller", "agent")}
    stored = tmp_path / "auth" / "passwords.json"
    stored.parent.mkdir()
    stored.write_text(json.dumps(old))
    auth = LocalAuth.create(tmp_path)
    assert set(auth.passwords) == set(USERS)
    assert {user: auth.passwords[user] for user in old} == old
    assert json.loads(stored.read_text()) == auth.passwords
    assert stat.S_IMODE(stored.stat().st_mode) == 0o600
    assert LocalAuth.create(tmp_path).passwords == auth.passwords


def test_a_producer_s_client_takes_the_producer_s_inbox_prefix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GROVE_NATS_USER", "producer")
    assert credentials_from_env()["inbox_prefix"] == PRODUCER_INBOX_PREFIX
    monkeypatch.setenv("GROVE_NATS_INBOX_PREFIX", "_INBOX_ingest")
    assert credentials_from_env()["inbox_prefix"] == "_INBOX_ingest"
    monkeypatch.delenv("GROVE_NATS_INBOX_PREFIX")
    monkeypatch.setenv("GROVE_NATS_USER", "caller")
    assert "inbox_prefix" not in credentials_from_env()


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

        caller = await EventLog.connect(secured_stack.caller_url, error_cb=on_error)
        try:
            await caller.nc.publish(f"grove.terminate.{agent}", b"{}")
            await caller.nc.flush()
            for _ in range(100):
                if denied:
                    break
                await asyncio.sleep(0.05)
        finally:
            await caller.close()
        assert denied, "a caller published a terminate"
        assert "permissions violation" in denied[0].lower()

    with pytest.raises(LogError):
        await EventLog.connect(secured_stack.url, allow_reconnect=False, reachable_within=2)


async def test_an_agent_process_connects_as_the_agent_user_never_as_the_spawner(
    secured_stack: Stack,
) -> None:
    probe = [sys.executable, "-c", "from tests.agents import probe_credentials_main as m; m()"]
    async with await GroveClient.connect(secured_stack.caller_url) as client:
        agent = await client.spawn("probe", build_config("command", command=probe))
        result = await client.wait(agent, timeout=60)
    assert result.reason == "completed", result.error
    assert json.loads(result.summary) == {
        "user": "agent",
        "url_has_user": False,
        "terminate_denied": True,
        "request_allowed": True,
    }


async def test_services_under_their_own_users_catch_up_through_helper_processes(
    secured_stack: Stack,
) -> None:
    async with await GroveClient.connect(secured_stack.caller_url) as client:
        agent = await client.spawn("two words", build_config("command", command=["wc", "-w"]))
        assert (await client.wait(agent, timeout=30)).reason == "completed"
        for name in ("governor", "router", "artifacts"):
            # From an empty projection, with any catch-up read by a helper: the helper
            # connects as the service's own user, from the service's settings.
            service = secured_stack.services[name]
            service.stop()
            (secured_stack.data_dir / f"{name}.db").unlink()
            service.env["GROVE_CATCH_UP_HELPER_MIN"] = "1"
            await asyncio.to_thread(secured_stack.restart, name)
            log = service.log_path.read_text()
            assert "a helper process reads them" in log, name
            assert "catch-up helper" not in log, name  # the helper itself reported no error
            assert "reading on from seq" not in log, name  # and it did not stop early
        assert (await client.summary(agent))["state"] == "completed"
        assert (await client.resource_status(agent))["self"]["phase"] == "ended"


def test_the_cli_finds_the_secured_stack_through_its_data_folder(secured_stack: Stack) -> None:
    result = grove(None, "--data-dir", str(secured_stack.data_dir), "status")
    assert result.returncode == 0, result.stderr
    assert "agents running: 0" in result.stdout


def test_auth_needs_the_stack_s_own_server(tmp_path: Path) -> None:
    stack = Stack(tmp_path / "grove", auth=True, nats_url="nats://127.0.0.1:4222")
    with pytest.raises(StackError, match="GROVE_NATS_USER"):
        stack.start()


# -- the roles outside the services: producer, caller, agent -----------------------------------


class Connection:
    """One NATS user's connection to the stack, with the errors the server reported to it."""

    def __init__(self, log: EventLog, errors: list[str]) -> None:
        self.log = log
        self.errors = errors

    @classmethod
    async def open(cls, stack: Stack, user: str) -> Connection:
        assert stack.local_auth is not None
        errors: list[str] = []

        async def on_error(exc: Exception) -> None:
            errors.append(str(exc))

        inbox = {"inbox_prefix": PRODUCER_INBOX_PREFIX} if user == "producer" else {}
        url = stack.local_auth.url_for(stack.url, user)
        log = await EventLog.connect(url, name=f"test-{user}", error_cb=on_error, **inbox)
        return cls(log, errors)

    async def refused(self, subject: str, timeout: float = 5) -> bool:
        """Whether the server reported a permissions violation naming `subject` (nats-py
        hands the server's error over in lower case)."""
        await self.log.nc.flush()
        wanted = f'"{subject.lower()}"'
        deadline = asyncio.get_running_loop().time() + timeout
        while asyncio.get_running_loop().time() < deadline:
            if any("permissions violation" in e and wanted in e for e in self.errors):
                return True
            await asyncio.sleep(0.05)
        return False

    async def unanswered(self, subject: str, body: dict[str, Any]) -> bool:
        """Whether a request to `subject` got no answer (it never reached a responder)."""
        try:
            await self.log.nc.request(subject, json.dumps(body).encode(), timeout=1)
        except nats.errors.TimeoutError:
            return True
        return False


async def pending_question(client: GroveClient, tree_id: str) -> dict[str, Any]:
    """The first unanswered question of a tree, once the router has it."""
    for _ in range(300):
        rows = await client.routing.pending(tree_id=tree_id)
        if rows:
            return rows[0]
        await asyncio.sleep(0.1)
    raise AssertionError(f"no question from tree {tree_id}")


def python_agent(entrypoint: str) -> Any:
    return build_config("python", entrypoint=entrypoint)


async def test_a_producer_cannot_decide_answer_or_read_artifacts(secured_stack: Stack) -> None:
    secret = b"the notes of tree A"
    async with await GroveClient.connect(secured_stack.caller_url) as client:
        asker = await client.spawn("which way?", python_agent("tests.routing_agents:asker"))
        question = await pending_question(client, asker)
        agent = await Connection.open(secured_stack, "agent")
        producer = await Connection.open(secured_stack, "producer")
        store = await Connection.open(secured_stack, "artifacts")
        try:
            stored = await Artifacts(agent.log, agent_id=asker).put(secret, name="notes.txt")

            # Work: a spawn is taken; a lifecycle decision is refused.
            await GroveClient(producer.log).spawn("work", python_agent("tests.agents:quick"))
            for kind in ("terminate", "status"):
                await producer.log.nc.publish(f"grove.{kind}.{asker}", b"{}")
                assert await producer.refused(f"grove.{kind}.{asker}"), kind

            # A question of another tree: the answer is refused and the question stays open.
            answer = HitlEvent(
                event_id=new_id(), agent_id=asker, action="response",
                request_id=question["request_id"], answer="left", by="caller",
            )  # fmt: skip
            await producer.log.nc.publish(f"grove.hitl.{asker}", answer.model_dump_json().encode())
            assert await producer.refused(f"grove.hitl.{asker}")
            assert (await client.routing.request(question["request_id"]))["pending"]

            # The artifact-store's requests are refused, whatever agent the request names.
            get = {"agent_id": asker, "artifact_id": stored.artifact_id}
            assert await producer.unanswered("grove.rpc.artifacts.get", get)
            assert await producer.refused("grove.rpc.artifacts.get")

            # The bucket's stream, read directly: refused, where the store's own user reads it.
            reads = {
                f"$JS.API.CONSUMER.CREATE.{OBJECT_STREAM}": {
                    "stream_name": OBJECT_STREAM,
                    "config": {"deliver_policy": "all", "ack_policy": "none"},
                },
                f"$JS.API.DIRECT.GET.{OBJECT_STREAM}": {"seq": 1},
                f"$JS.API.STREAM.MSG.GET.{OBJECT_STREAM}": {"seq": 1},
            }
            for subject, body in reads.items():
                assert await producer.unanswered(subject, body), subject
                assert await producer.refused(subject), subject
            direct = await store.log.nc.request(
                f"$JS.API.DIRECT.GET.{OBJECT_STREAM}", b'{"seq": 1}', timeout=5
            )
            assert direct.data, "the bucket holds the blob the producer was refused"

            # Listening where the others' replies arrive: refused, and nothing reaches it.
            overheard: list[bytes] = []

            async def listen(msg: Any) -> None:
                overheard.append(msg.data)

            await producer.log.nc.subscribe("_INBOX.>", cb=listen)
            assert await producer.refused("_INBOX.>")
            assert await client.artifacts.get(stored.artifact_id) == secret
            await asyncio.sleep(0.5)
            assert overheard == []
            assert await producer.log.last_seq() > 0  # it still reads the log
        finally:
            for connection in (agent, producer, store):
                await connection.log.close()
        await client.answer(question["request_id"], "left")
        assert (await client.wait(asker, timeout=30)).summary == "answer: left"


@pytest.mark.parametrize("role", ["caller", "agent"])
async def test_callers_and_agents_answer_and_read_artifacts_through_the_store(
    secured_stack: Stack, role: str
) -> None:
    secret = b"what the child found"
    async with await GroveClient.connect(secured_stack.caller_url) as client:
        root = await client.spawn("which way?", python_agent("tests.routing_agents:middle"))
        stranger = await client.spawn("60", python_agent("tests.agents:sleeper"))
        question = await pending_question(client, root)
        agent = await Connection.open(secured_stack, "agent")
        user = await Connection.open(secured_stack, role)
        try:
            child = question["agent_id"]
            stored = await Artifacts(agent.log, agent_id=child).put(secret, name="found.txt")

            # Reading through the store: the caller any tree's, an agent its own tree's only
            # (the tree check of tests/integration/test_artifacts.py, under this user).
            reader = Artifacts(user.log) if role == "caller" else Artifacts(user.log, agent_id=root)
            assert await reader.get(stored.artifact_id) == secret
            with pytest.raises(ArtifactError, match="belongs to another tree"):
                await Artifacts(user.log, agent_id=stranger).get(stored.artifact_id)
            subject = f"$JS.API.STREAM.MSG.GET.{OBJECT_STREAM}"
            assert await user.unanswered(subject, {"seq": 1})
            assert await user.refused(subject)

            # Answering: the caller any question, an agent its children's.
            answerer = GroveClient(user.log, identity="caller" if role == "caller" else root)
            await answerer.answer(question["request_id"], "left")
            assert (await client.wait(root, timeout=30)).summary == "answer: left"
            assert all(subject.lower() in e for e in user.errors), user.errors
        finally:
            for connection in (agent, user):
                await connection.log.close()
        await client.stop(stranger)

"""The client side of the artifact-store: put, get, list and delete artifacts.

The store answers JSON on `grove.rpc.artifacts.<verb>` (see `grove_artifacts.service` for the
protocol). One NATS message is limited (1 MB by default), so this client moves bytes in
pieces: a put that fits one message goes whole, a larger one as an upload of chunks and a
commit; a get asks for the next chunks with the cursor of the previous answer until the end,
and checks the sha256 of what it joined.

An `Artifacts` speaks for an agent (`agent_id`: it sees its own tree's artifacts only), or for
a caller that is no agent, optionally naming one tree (`tree_id`).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
from dataclasses import dataclass, fields
from typing import Any

import nats.errors

from grove_core.log import EventLog, LogError
from grove_events import new_id, rpc_subject

#: Seconds one request to the artifact-store may take.
ARTIFACTS_TIMEOUT_S = 10.0
#: The slowest a commit is expected to write a blob into the bucket, in bytes per second.
COMMIT_BYTES_PER_S = 2_000_000
#: Most bytes of data in one message, before base64 (less when the server's limit is lower).
MAX_PIECE_BYTES = 512 * 1024
#: Room left in a message for the JSON around the data.
ENVELOPE_BYTES = 4096
TEXT = "text/plain; charset=utf-8"
#: Seconds the spawner keeps trying to store an over-budget result (GROVE_RESULT_STORE_TIMEOUT).
RESULT_STORE_TIMEOUT_S = 15.0
#: How long a put keeps trying while the artifact-store restarts, and the pause between tries.
STORE_RESTART_S = 60.0
STORE_RETRY_S = 0.5


class ArtifactError(LogError):
    """The artifact-store refused a request; the message says why and what to do."""


class ArtifactStoreUnavailable(ArtifactError):
    """The artifact-store did not answer in time (it may be down or restarting)."""


@dataclass(frozen=True)
class Artifact:
    """An artifact as the index has it."""

    artifact_id: str
    tree_id: str | None
    agent_id: str
    name: str
    media_type: str
    size: int
    sha256: str
    seq: int = 0

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Artifact:
        """From the store's JSON."""
        return cls(**{f.name: row[f.name] for f in fields(cls) if f.name in row})


def piece_bytes(max_payload: int) -> int:
    """Most raw bytes one message carries base64-encoded under the server's payload limit."""
    return max(1024, min(MAX_PIECE_BYTES, (max_payload - ENVELOPE_BYTES) * 3 // 4))


class Artifacts:
    """Artifact operations over one connection, for an agent or for a caller."""

    def __init__(
        self,
        log: EventLog,
        *,
        agent_id: str | None = None,
        tree_id: str | None = None,
        timeout: float = ARTIFACTS_TIMEOUT_S,
        restart_wait: float = STORE_RESTART_S,
    ) -> None:
        if agent_id is not None and tree_id is not None:
            raise ValueError("an Artifacts speaks for an agent or names a tree, not both")
        self.log = log
        self.agent_id = agent_id
        self.tree_id = tree_id
        self.timeout = timeout
        self.restart_wait = restart_wait

    async def rpc(
        self, verb: str, request: dict[str, Any], timeout: float | None = None
    ) -> dict[str, Any]:
        """Ask the store; ArtifactError with its message when it refuses."""
        timeout = timeout or self.timeout
        try:
            reply = await self.log.nc.request(
                rpc_subject("artifacts", verb), json.dumps(request).encode(), timeout=timeout
            )
        except nats.errors.NoRespondersError:
            raise ArtifactStoreUnavailable(
                f"no artifact-store is answering `{verb}` (restarting, or not running: `grove up`)"
            ) from None
        except (TimeoutError, nats.errors.Error):
            raise ArtifactStoreUnavailable(
                f"the artifact-store did not answer `{verb}` within {timeout:g}s; is it "
                "running (`grove up`)?"
            ) from None
        answer: dict[str, Any] = json.loads(reply.data)
        if set(answer) == {"error"}:
            raise ArtifactError(str(answer["error"]))
        return answer

    def _scope(self) -> dict[str, Any]:
        if self.agent_id is not None:
            return {"agent_id": self.agent_id}
        if self.tree_id is not None:
            return {"tree_id": self.tree_id}
        return {}

    def _owner(self, agent_id: str | None) -> str:
        owner = agent_id or self.agent_id
        if owner is None:
            raise ValueError("an artifact belongs to an agent: give agent_id")
        return owner

    async def put(
        self,
        data: bytes | str,
        *,
        name: str,
        media_type: str | None = None,
        agent_id: str | None = None,
        after_seq: int | None = None,
        put_id: str | None = None,
    ) -> Artifact:
        """Store `data` (text is stored as UTF-8, `text/plain` unless told) as an artifact of
        `agent_id` (default: the agent this speaks for). `after_seq`: the store answers once
        it has folded the log that far (e.g. past the agent's spawn).

        The put is tried again while the artifact-store restarts (for up to `restart_wait`
        seconds), under one `put_id` (the artifact's id; new unless given), so it
        is stored once even when an attempt's answer was lost."""
        if isinstance(data, str):
            data = data.encode()
            media_type = media_type or TEXT
        request: dict[str, Any] = {
            "agent_id": self._owner(agent_id),
            "name": name,
            "media_type": media_type or "application/octet-stream",
            "size": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
            "put_id": put_id or new_id(),
        }
        if after_seq is not None:
            request["after_seq"] = after_seq
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.restart_wait
        while True:
            try:
                return await self._put_once(request, data)
            except ArtifactStoreUnavailable:
                if loop.time() + STORE_RETRY_S > deadline:
                    raise
                await asyncio.sleep(STORE_RETRY_S)

    async def _put_once(self, request: dict[str, Any], data: bytes) -> Artifact:
        if len(data) <= piece_bytes(self.log.nc.max_payload):
            request["data"] = base64.b64encode(data).decode()
            answer = await self.rpc("put", request)
            return Artifact.from_row(answer["artifact"])
        opened = await self.rpc("put", request)
        if "artifact" in opened:  # an earlier attempt of this put stored it
            return Artifact.from_row(opened["artifact"])
        upload_id = opened["upload_id"]
        step = min(int(opened["chunk_bytes"]), piece_bytes(self.log.nc.max_payload))
        for offset in range(0, len(data), step):
            piece = base64.b64encode(data[offset : offset + step]).decode()
            await self.rpc("put_chunk", {"upload_id": upload_id, "offset": offset, "data": piece})
        # The commit writes the whole blob into the bucket: allow for its size.
        writing = len(data) / COMMIT_BYTES_PER_S
        answer = await self.rpc("put_commit", {"upload_id": upload_id}, self.timeout + writing)
        return Artifact.from_row(answer["artifact"])

    async def read(self, artifact_id: str) -> tuple[Artifact, bytes]:
        """An artifact and its bytes (checked against its sha256)."""
        request: dict[str, Any] = {"artifact_id": artifact_id, **self._scope()}
        out = bytearray()
        while True:
            answer = await self.rpc("get", {**request, "offset": len(out)})
            out += base64.b64decode(answer["data"])
            if answer["eof"]:
                break
            request["cursor"] = answer["cursor"]
        artifact = Artifact.from_row(answer["artifact"])
        if len(out) != artifact.size or hashlib.sha256(out).hexdigest() != artifact.sha256:
            raise ArtifactError(
                f"artifact {artifact_id} came back with {len(out)} bytes that do not match its "
                f"size {artifact.size} and sha256; read it again"
            )
        return artifact, bytes(out)

    async def get(self, artifact_id: str) -> bytes:
        """An artifact's bytes."""
        return (await self.read(artifact_id))[1]

    async def get_text(self, artifact_id: str) -> str:
        """An artifact's bytes as UTF-8 text."""
        return (await self.get(artifact_id)).decode("utf-8", errors="replace")

    async def list(self, *, owner: str | None = None) -> list[Artifact]:
        """The live artifacts in scope (this agent's tree, the named tree, or all), oldest
        first; `owner` keeps those of one agent."""
        request = self._scope()
        if owner is not None:
            request["owner"] = owner
        answer = await self.rpc("list", request)
        return [Artifact.from_row(row) for row in answer["artifacts"]]

    async def delete(self, artifact_id: str, *, agent_id: str | None = None) -> Artifact:
        """Delete an artifact of the tree of `agent_id` (default: the agent this speaks for)."""
        answer = await self.rpc(
            "delete", {"agent_id": self._owner(agent_id), "artifact_id": artifact_id}
        )
        return Artifact.from_row(answer["deleted"])


async def store_result(
    log: EventLog,
    agent_id: str,
    text: str,
    *,
    after_seq: int | None = None,
    within: float | None = None,
) -> Artifact:
    """Store an agent's full result as a text artifact of that agent, asking again while the
    store does not answer, for at most `within` seconds (default GROVE_RESULT_STORE_TIMEOUT,
    else 15); raises ArtifactError when it refuses or stays silent."""
    if within is None:
        within = float(os.environ.get("GROVE_RESULT_STORE_TIMEOUT", RESULT_STORE_TIMEOUT_S))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    put_id = new_id()  # every attempt is the same put: the result is stored once
    while True:
        remaining = deadline - loop.time()
        artifacts = Artifacts(
            log,
            agent_id=agent_id,
            timeout=max(0.5, min(5.0, remaining)),
            restart_wait=max(0.0, remaining),
        )
        try:
            return await artifacts.put(
                text,
                name=f"result-{agent_id}.txt",
                media_type=TEXT,
                after_seq=after_seq,
                put_id=put_id,
            )
        except ArtifactStoreUnavailable:
            if loop.time() + 0.5 >= deadline:
                raise
        except ArtifactError:
            raise
        except LogError as exc:
            if loop.time() + 0.5 >= deadline:
                raise ArtifactStoreUnavailable(str(exc)) from None
        await asyncio.sleep(0.5)

"""The artifact-store's application layer: put, get, list and delete over request-reply.

Requests are JSON on `grove.rpc.artifacts.<verb>`; answers are JSON, a refusal is
`{"error": "..."}` alone. Binary data travels base64-encoded in a `data` field. Every request
names who asks: `agent_id` (an agent: it sees only its own tree's artifacts) or, for a caller
that is no agent (the operator's CLI), optionally `tree_id`; with neither, all trees. Puts and
deletes need `agent_id`: an artifact always belongs to an agent and its tree. A request may
carry `after_seq`: it is answered once the index has folded the log that far.

NATS limits one message (1 MB by default), so bytes move in pieces that each fit one:

- `put {agent_id, name, media_type?, size, sha256?, data?}`: with `data` (the whole content,
  when it fits in one message) the artifact is stored at once. Without, an upload opens and the
  answer is `{upload_id, chunk_bytes}`; the caller then sends `put_chunk {upload_id, offset,
  data}` in order, each at most `chunk_bytes`, and `put_commit {upload_id}`. The store hashes
  what it received; the bytes must match `size` (and `sha256`, when given). Uploads are staged
  in a file of this process and dropped after `UPLOAD_IDLE_S` seconds without a chunk.
- `get {artifact_id, cursor?}` answers `{artifact, offset, data, cursor, eof}`: whole chunks
  of the blob from `cursor` (none: the start); the caller asks again with the answer's
  `cursor` until `eof`, and checks the sha256 of what it joined.

Blobs are content-addressed: a put whose bytes are already in the bucket writes no blob, but
it is its own artifact (its own id, name, owner and index entry; two puts of the same bytes are
two artifacts and one blob). The bytes are always sent: a sha256 alone, which anyone reading
the log can see, never gives access to a blob. A delete appends `artifact action=delete`; the
blob goes once no live artifact refers to it. Limits (`artifacts.max_artifact_bytes`,
`artifacts.max_tree_bytes` in the config file) are checked when a put opens, counting uploads
in progress against their tree.

The index is the fold of the log (grove_artifacts.domain), so a restart, or a lost database,
rebuilds it; after catching up, blobs no live artifact refers to (left by a crash between a
blob's write and its event, or a delete and the blob's removal) are removed.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import io
import logging
import re
import tempfile
import time
import weakref
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prometheus_client import Counter as Metric
from prometheus_client import Gauge

from grove_artifacts.blobs import CHUNK_BYTES, SHA256, BlobError, BlobStore
from grove_artifacts.domain import (
    FOLD_VERSION,
    FOLDED_KINDS,
    ArtifactEntry,
    ArtifactIndex,
    evolve,
)
from grove_core.config import ArtifactLimits, load_config
from grove_core.log import EventLog
from grove_core.projection import ProjectionRunner, ProjectionStore
from grove_core.records import Recorded
from grove_core.rpc import RpcServer, behind
from grove_core.service import Service, run_service
from grove_core.settings import ServiceSettings
from grove_events import ArtifactEvent, new_id
from grove_events.envelope import TOKEN_PATTERN

log = logging.getLogger(__name__)

NAME = "artifacts"
#: What the index reads of the log: what its fold reads (the hook reads artifacts only).
PROJECTION_KINDS = FOLDED_KINDS
#: Seconds an upload may wait for its next chunk before it is dropped.
UPLOAD_IDLE_S = 60.0
#: Longest wait for `after_seq`, or for the index to catch up with the log (shorter than a
#: client's request timeout, so that it gets the reason rather than a timeout).
MAX_WAIT_S = 4.0
#: Most bytes of data in one message, before base64 (less when the server's limit is lower).
MAX_PIECE_BYTES = 512 * 1024
#: Room left in a message for the JSON around the data.
ENVELOPE_BYTES = 4096
MEDIA_TYPE = re.compile(r"^[\w.+-]+/[\w.+-]+(\s*;.{0,200})?$")
#: Characters no artifact name may hold: controls (NUL, newlines...) and the backslash.
NAME_FORBIDDEN = re.compile(r"[\x00-\x1f\x7f\\]")

STORED_BYTES = Gauge(
    "grove_artifact_bytes", "Bytes of live artifacts (a blob shared by several counted each time)."
)
BLOB_BYTES = Gauge("grove_artifact_blob_bytes", "Bytes of the distinct blobs live artifacts use.")
ARTIFACTS = Gauge("grove_artifacts", "Live artifacts.")
REFUSED = Metric(
    "grove_artifact_requests_refused_total", "Artifact requests refused, by reason.", ["reason"]
)

Answer = dict[str, Any]


def _count_refusal(exc: Exception) -> None:
    """Count a refused request by its reason (`blob` for a blob error, `store_full`...)."""
    reason = getattr(exc, "reason", "refused")
    REFUSED.labels(reason).inc()


class Refused(ValueError):
    """A request the store will not carry out; `reason` labels the refusal metric."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def piece_bytes(max_payload: int) -> int:
    """Most raw bytes one message may carry base64-encoded, under the server's payload limit."""
    return max(CHUNK_BYTES, min(MAX_PIECE_BYTES, (max_payload - ENVELOPE_BYTES) * 3 // 4))


def check_name(name: str) -> None:
    """Refuse a name that could lead whoever saves the artifact by its name out of a folder: a
    name is a relative path of plain segments (`notes.md`, `reports/week-1.md`)."""
    if len(name) > 512:
        raise Refused("bad_request", "'name' must be at most 512 characters")
    if NAME_FORBIDDEN.search(name):
        raise Refused(
            "bad_request", "'name' may not hold control characters or backslashes: " + repr(name)
        )
    if name.startswith("/"):
        raise Refused("bad_request", f"'name' must be a relative path, not {name!r}")
    if any(segment in ("", ".", "..") for segment in name.split("/")):
        raise Refused(
            "bad_request",
            f"'name' {name!r} has an empty, '.' or '..' segment; names are plain relative paths",
        )


def _text(request: dict[str, Any], name: str, *, required: bool = True) -> str | None:
    value = request.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value:
        raise Refused("bad_request", f"'{name}' must be a non-empty string")
    return value


def _token(request: dict[str, Any], name: str, *, required: bool = True) -> str | None:
    value = _text(request, name, required=required)
    if value is not None and not TOKEN_PATTERN.fullmatch(value):
        raise Refused("bad_request", f"'{name}' must be 1-128 letters, digits, '-' or '_'")
    return value


def _count(request: dict[str, Any], name: str, default: int | None = None) -> int:
    value = request.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise Refused("bad_request", f"'{name}' must be a whole number of at least 0")
    return value


def _data(request: dict[str, Any]) -> bytes:
    value = request.get("data")
    if not isinstance(value, str):
        raise Refused("bad_request", "'data' must be the bytes as a base64 string")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise Refused("bad_request", "'data' is not valid base64") from None


def artifact_row(entry: ArtifactEntry) -> Answer:
    """An artifact as the store reports it."""
    return asdict(entry)


@dataclass
class Upload:
    """A put in progress: what it will be, and the bytes received so far."""

    upload_id: str
    agent_id: str
    tree_id: str
    name: str
    media_type: str
    size: int
    sha256: str | None
    #: The caller's id for the put (its retries carry the same), or None.
    put_id: str | None = None
    file: io.BufferedRandom | None = None
    received: int = 0
    hasher: Any = field(default_factory=hashlib.sha256)
    touched: float = field(default_factory=time.monotonic)
    released: bool = False

    def close(self) -> None:
        """Drop the staged bytes."""
        if self.file is not None:
            self.file.close()
            self.file = None


class ArtifactStore:
    """Keeps the artifact index and answers `grove.rpc.artifacts.<verb>`."""

    def __init__(
        self,
        event_log: EventLog,
        store: ProjectionStore,
        blobs: BlobStore,
        limits: ArtifactLimits,
        staging: Path,
    ) -> None:
        self.log = event_log
        self.blobs = blobs
        self.limits = limits
        self.staging = staging
        self.runner: ProjectionRunner[ArtifactIndex] = ProjectionRunner(
            name=NAME,
            log=event_log,
            store=store,
            state_type=ArtifactIndex,
            evolve=evolve,
            after_event=self._after_event,
            kinds=PROJECTION_KINDS,
            # Spawns, forks and artifacts are one event in five of an agent's life: once caught
            # up, the server sends the index only those.
            follow_kinds_only=True,
            fold_version=FOLD_VERSION,
        )
        self.uploads: dict[str, Upload] = {}
        #: tree id -> bytes of the uploads in progress in it
        self.reserved: Counter[str] = Counter()
        self._blob_locks: weakref.WeakValueDictionary[str, asyncio.Lock] = (
            weakref.WeakValueDictionary()
        )
        self.verbs: dict[str, Callable[[dict[str, Any]], Awaitable[Answer]]] = {
            "put": self.put,
            "put_chunk": self.put_chunk,
            "put_commit": self.put_commit,
            "get": self.get,
            "list": self.list,
            "delete": self.delete,
        }
        self.rpc = RpcServer(
            NAME,
            self.verbs,
            wait_applied=self.wait_applied,
            refusals=(Refused, BlobError),
            on_refused=_count_refusal,
        )

    @property
    def state(self) -> ArtifactIndex:
        """The current fold."""
        return self.runner.state

    async def _after_event(self, recorded: Recorded, live: bool) -> None:
        if isinstance(recorded.event, ArtifactEvent):
            self.update_gauges()

    def update_gauges(self) -> None:
        """Set the stored bytes and counts from the index."""
        STORED_BYTES.set(self.state.total_bytes)
        BLOB_BYTES.set(self.state.blob_bytes)
        ARTIFACTS.set(self.state.total_count)

    async def wait_applied(self, seq: int, timeout: float | None = None) -> None:
        """Wait until the index has folded the log to `seq`; refused after `timeout` (at most,
        and by default, `MAX_WAIT_S`)."""
        timeout = MAX_WAIT_S if timeout is None else min(timeout, MAX_WAIT_S)
        if not await self.runner.reached(seq, timeout):
            raise Refused("behind", behind("artifact index", self.runner.applied_seq, seq, timeout))

    # -- serving -----------------------------------------------------------------------------

    @property
    def piece(self) -> int:
        """Most raw bytes in one message's `data`."""
        return piece_bytes(self.log.nc.max_payload)

    # -- who asks ----------------------------------------------------------------------------

    async def tree_of(self, agent_id: str) -> str:
        """The agent's tree, waiting for the index to catch up with the log if needed."""
        tree = self.state.tree_of(agent_id)
        if tree is None:
            with contextlib.suppress(Refused):
                await self.wait_applied(await self.log.last_seq())
            tree = self.state.tree_of(agent_id)
        if tree is None:
            raise Refused(
                "unknown_agent",
                f"no agent {agent_id!r} in the log; artifacts belong to the agents of a tree "
                "(`grove tree` lists them)",
            )
        return tree

    async def scope(self, request: dict[str, Any]) -> str | None:
        """The tree a request may see: its agent's, the one it names, or None (all)."""
        agent_id = _token(request, "agent_id", required=False)
        tree_id = _token(request, "tree_id", required=False)
        if agent_id is not None and tree_id is not None:
            raise Refused(
                "bad_request",
                "give 'agent_id' (an agent sees its own tree) or 'tree_id', not both",
            )
        if agent_id is not None:
            return await self.tree_of(agent_id)
        return tree_id

    def entry(self, artifact_id: str, tree: str | None) -> ArtifactEntry:
        """A live artifact the scope may see."""
        entry = self.state.artifacts.get(artifact_id)
        if entry is None:
            raise Refused(
                "not_found", f"no artifact {artifact_id!r}; `grove artifacts ls` lists them"
            )
        if tree is not None and entry.tree_id != tree:
            raise Refused(
                "other_tree",
                f"artifact {artifact_id!r} belongs to another tree than {tree!r}; an agent "
                "reads only its own tree's artifacts",
            )
        if entry.deleted:
            raise Refused(
                "not_found", f"artifact {artifact_id!r} was deleted by {entry.deleted_by}"
            )
        return entry

    # -- put ---------------------------------------------------------------------------------

    async def put(self, request: dict[str, Any]) -> Answer:
        """{agent_id, name, media_type?, size, sha256?, data?, put_id?} -> {artifact} when
        `data` was given, else {upload_id, chunk_bytes} (then `put_chunk`s and `put_commit`).

        `put_id` makes a retried put idempotent: it becomes the artifact's id, and a put whose
        artifact exists already answers with it (stored once, even if the first attempt's
        answer was lost)."""
        agent_id = _token(request, "agent_id")
        assert agent_id is not None
        put_id = _token(request, "put_id", required=False)
        if put_id is not None and put_id in self.state.artifacts:
            return self._earlier_put(put_id, await self.tree_of(agent_id))
        name = _text(request, "name")
        assert name is not None
        check_name(name)
        media_type = _text(request, "media_type", required=False) or "application/octet-stream"
        if not MEDIA_TYPE.fullmatch(media_type):
            raise Refused("bad_request", f"'media_type' {media_type!r} is not a type/subtype")
        size = _count(request, "size")
        sha256 = _text(request, "sha256", required=False)
        if sha256 is not None and not SHA256.fullmatch(sha256):
            raise Refused("bad_request", "'sha256' must be 64 lowercase hex digits")
        data = _data(request) if "data" in request else None
        tree = await self.tree_of(agent_id)
        self._check_limits(tree, size)
        upload = Upload(new_id(), agent_id, tree, name, media_type, size, sha256, put_id)
        self.reserved[tree] += size
        if data is None:
            upload.file = tempfile.TemporaryFile(dir=self.staging)  # noqa: SIM115 - closed by close()
            self.uploads[upload.upload_id] = upload
            return {"upload_id": upload.upload_id, "chunk_bytes": self.piece}
        try:
            self._receive(upload, 0, data)
            return await self._commit(upload, io.BytesIO(data))
        finally:
            self._release(upload)

    def _earlier_put(self, put_id: str, tree: str) -> Answer:
        """The artifact an earlier attempt of this put stored."""
        entry = self.state.artifacts[put_id]
        if entry.deleted:
            raise Refused(
                "bad_request",
                f"put_id {put_id!r} was the id of an artifact deleted since; put again with a "
                "new id",
            )
        if self.state.tree_of(entry.agent_id) != tree:
            raise Refused(
                "bad_request", f"put_id {put_id!r} is an artifact of another tree; use a new id"
            )
        log.info("artifact %s: a retried put, stored once", put_id)
        return {"artifact": artifact_row(entry)}

    def _check_limits(self, tree: str, size: int) -> None:
        limit = self.limits.max_artifact_bytes
        if size > limit:
            raise Refused(
                "too_large",
                f"an artifact of {size} bytes is over artifacts.max_artifact_bytes={limit}; "
                "store it in parts or raise the limit in the config file",
            )
        held = self.state.tree_bytes[tree] + self.reserved[tree]
        tree_limit = self.limits.max_tree_bytes
        if held + size > tree_limit:
            raise Refused(
                "tree_full",
                f"tree {tree} holds {held} bytes of artifacts; {size} more would be over "
                f"artifacts.max_tree_bytes={tree_limit}: delete some (`grove artifacts rm`) or "
                "raise the limit in the config file",
            )

    def _receive(self, upload: Upload, offset: int, data: bytes) -> None:
        if offset != upload.received:
            raise Refused(
                "bad_request",
                f"upload {upload.upload_id} has {upload.received} bytes; the next chunk must "
                f"start at offset {upload.received}, not {offset}",
            )
        if upload.received + len(data) > upload.size:
            raise Refused(
                "bad_request",
                f"upload {upload.upload_id} would get more than the {upload.size} bytes the put "
                "declared",
            )
        upload.hasher.update(data)
        upload.received += len(data)
        upload.touched = time.monotonic()

    def _release(self, upload: Upload) -> None:
        """End an upload: its bytes no longer count as reserved against its tree."""
        upload.close()
        self.uploads.pop(upload.upload_id, None)
        if upload.released:
            return
        upload.released = True
        self.reserved[upload.tree_id] -= upload.size
        if self.reserved[upload.tree_id] <= 0:
            del self.reserved[upload.tree_id]

    def _upload(self, request: dict[str, Any]) -> Upload:
        upload_id = _token(request, "upload_id")
        assert upload_id is not None
        upload = self.uploads.get(upload_id)
        if upload is None:
            raise Refused(
                "unknown_upload",
                f"no upload {upload_id!r} in progress (it was committed, dropped after "
                f"{UPLOAD_IDLE_S:g}s idle, or the store restarted); put the artifact again",
            )
        return upload

    async def put_chunk(self, request: dict[str, Any]) -> Answer:
        """{upload_id, offset, data} -> {received}: the next bytes of an upload."""
        upload = self._upload(request)
        offset = _count(request, "offset")
        data = _data(request)
        file = upload.file
        assert file is not None
        self._receive(upload, offset, data)
        # Written before any other request runs: the file holds exactly what was hashed, in
        # order (a piece is at most MAX_PIECE_BYTES, a short blocking write).
        file.write(data)
        return {"upload_id": upload.upload_id, "received": upload.received}

    async def put_commit(self, request: dict[str, Any]) -> Answer:
        """{upload_id} -> {artifact}: check and store what the upload received."""
        upload = self._upload(request)
        # Taken off the uploads at once: a second commit of it is refused, not run twice.
        self.uploads.pop(upload.upload_id)
        try:
            file = upload.file
            assert file is not None
            file.seek(0)
            return await self._commit(upload, file)
        finally:
            self._release(upload)

    async def _commit(self, upload: Upload, source: io.BufferedIOBase) -> Answer:
        """Write the blob unless the bucket has it, append the put, wait until it is folded."""
        if upload.received != upload.size:
            raise Refused(
                "bad_request",
                f"the put got {upload.received} of the {upload.size} bytes it declared; put the "
                "artifact again",
            )
        sha256 = upload.hasher.hexdigest()
        if upload.sha256 is not None and upload.sha256 != sha256:
            raise Refused(
                "checksum",
                f"the bytes received hash to sha256 {sha256}, not {upload.sha256} as the put "
                "said; nothing was stored",
            )
        async with self._blob_lock(sha256):
            if not await self.blobs.has(sha256, upload.size):
                await self.blobs.put(sha256, source)
            event = ArtifactEvent(
                # A retried put (same put_id) is stored once: the log drops the second append.
                event_id=upload.put_id or new_id(),
                agent_id=upload.agent_id,
                tree_id=upload.tree_id,
                timestamp=datetime.now(UTC),
                correlation_id=upload.upload_id,
                action="put",
                artifact_id=upload.put_id or new_id(),
                name=upload.name,
                media_type=upload.media_type,
                size=upload.size,
                sha256=sha256,
            )
            appended = await self.log.append(event)
            await self.wait_applied(appended.seq)
        stored = self.state.artifacts.get(event.artifact_id)
        if stored is None or stored.deleted:
            raise Refused(
                "bad_request",
                f"put_id {event.artifact_id!r} was the id of an artifact deleted since; put "
                "again with a new id",
            )
        log.info(
            "artifact %s: %s bytes for %s (tree %s)",
            event.artifact_id,
            upload.size,
            upload.agent_id,
            upload.tree_id,
        )
        return {"artifact": artifact_row(self.state.artifacts[event.artifact_id])}

    def _blob_lock(self, sha256: str) -> asyncio.Lock:
        # One writer or deleter of a blob at a time: a put that finds the blob must not have
        # it removed under it by the delete of the last other artifact using it.
        lock = self._blob_locks.get(sha256)
        if lock is None:
            lock = asyncio.Lock()
            self._blob_locks[sha256] = lock
        return lock

    def drop_idle(self, now: float) -> int:
        """Drop the uploads that, at monotonic time `now`, got no chunk for `UPLOAD_IDLE_S`
        seconds; returns how many."""
        idle = [u for u in self.uploads.values() if now - u.touched > UPLOAD_IDLE_S]
        for upload in idle:
            log.info("upload %s dropped: idle", upload.upload_id)
            self._release(upload)
        return len(idle)

    async def drop_idle_uploads(self) -> None:
        """Drop idle uploads, every few seconds."""
        while True:
            await asyncio.sleep(UPLOAD_IDLE_S / 4)
            self.drop_idle(time.monotonic())

    # -- get, list, delete -------------------------------------------------------------------

    async def get(self, request: dict[str, Any]) -> Answer:
        """{artifact_id, agent_id?|tree_id?, cursor?, offset?} -> {artifact, offset, data,
        cursor, eof}: the next bytes of the artifact."""
        artifact_id = _token(request, "artifact_id")
        assert artifact_id is not None
        cursor = _text(request, "cursor", required=False)
        offset = _count(request, "offset", 0)
        if cursor is None and offset:
            raise Refused("bad_request", "an 'offset' above 0 needs the previous answer's 'cursor'")
        entry = self.entry(artifact_id, await self.scope(request))
        try:
            chunks = await self.blobs.read(entry.sha256, cursor, self.piece)
        except ValueError as exc:
            raise Refused("bad_request", str(exc)) from None
        return {
            "artifact": artifact_row(entry),
            "offset": offset,
            "data": base64.b64encode(chunks.data).decode(),
            "cursor": chunks.cursor,
            "eof": chunks.cursor is None,
        }

    async def list(self, request: dict[str, Any]) -> Answer:
        """{agent_id?|tree_id?, owner?} -> {artifacts, bytes, count}: the live artifacts the
        scope may see, oldest first; `owner` keeps one agent's."""
        tree = await self.scope(request)
        owner = _token(request, "owner", required=False)
        entries = [e for e in self.state.live(tree) if owner is None or e.agent_id == owner]
        return {
            "tree_id": tree,
            "artifacts": [artifact_row(e) for e in entries],
            "bytes": sum(e.size for e in entries),
            "count": len(entries),
        }

    async def delete(self, request: dict[str, Any]) -> Answer:
        """{agent_id, artifact_id} -> {deleted}: an artifact of the agent's tree is deleted;
        its blob goes when no live artifact uses it any more."""
        agent_id = _token(request, "agent_id")
        artifact_id = _token(request, "artifact_id")
        assert agent_id is not None
        assert artifact_id is not None
        entry = self.entry(artifact_id, await self.tree_of(agent_id))
        async with self._blob_lock(entry.sha256):
            appended = await self.log.append(
                ArtifactEvent(
                    event_id=new_id(),
                    agent_id=agent_id,
                    tree_id=entry.tree_id,
                    timestamp=datetime.now(UTC),
                    action="delete",
                    artifact_id=entry.artifact_id,
                    name=entry.name,
                    media_type=entry.media_type,
                    size=entry.size,
                    sha256=entry.sha256,
                )
            )
            await self.wait_applied(appended.seq)
            if self.state.blob_refs[entry.sha256] == 0:
                await self.blobs.delete(entry.sha256)
        return {"deleted": artifact_row(self.state.artifacts[artifact_id])}

    async def sweep(self) -> int:
        """Remove the blobs no live artifact refers to; returns how many went."""
        removed = 0
        for name in await self.blobs.names():
            if self.state.blob_refs[name] == 0:
                async with self._blob_lock(name):
                    if self.state.blob_refs[name] == 0:
                        await self.blobs.delete(name)
                        removed += 1
        return removed


async def setup(service: Service) -> None:
    """Start the artifact-store inside a service process."""
    assert service.log is not None
    settings = service.settings
    limits = load_config(settings.config_path()).artifacts
    staging = settings.data_dir / "artifact-uploads"
    staging.mkdir(parents=True, exist_ok=True)
    blobs = await BlobStore.open(
        service.log.js,
        replicas=service.log.definition.replicas,
        max_bytes=limits.max_store_bytes,
    )
    store = ArtifactStore(
        service.log, ProjectionStore(settings.database_for(NAME)), blobs, limits, staging
    )
    service.ready_checks.append(store.runner.ready)
    service.ready_checks.append(store.rpc.is_serving)
    service.spawn(store.runner.run(), "artifacts-projection")
    await store.runner.caught_up.wait()
    store.update_gauges()
    removed = await store.sweep()
    if removed:
        log.info("removed %s blobs no artifact refers to", removed)
    service.spawn(store.drop_idle_uploads(), "artifacts-uploads")
    await service.serve_rpc(store.rpc)


def main() -> None:
    """`python -m grove_artifacts`."""
    run_service(NAME, setup, ServiceSettings())

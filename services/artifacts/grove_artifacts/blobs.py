"""Blobs in a JetStream object store bucket, each named by the sha256 of its bytes.

A blob is written once with nats-py's object store (`put`), in chunks of `CHUNK_BYTES`, and
read back a range at a time: a read returns whole chunks from a cursor and the cursor of the
next chunk. A cursor names the blob's chunk subject (its nuid), so a blob that was rewritten
between two reads is noticed instead of mixing two writes.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass
from typing import Any

import nats.js.errors
from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.object_store import OBJ_CHUNKS_PRE_TEMPLATE, OBJ_STREAM_TEMPLATE, ObjectStore

#: The bucket the artifact-store keeps its blobs in.
BUCKET = "grove-artifacts"
#: Size of one chunk of a blob in the bucket.
CHUNK_BYTES = 128 * 1024
SHA256 = re.compile(r"^[0-9a-f]{64}$")


#: JetStream's error codes for a stream that cannot take more: at its limits (10077), or the
#: server out of storage (10023, "insufficient resources").
FULL_CODES = frozenset({10077, 10023})


class BlobError(RuntimeError):
    """A blob is missing or changed under a reader; the message says what to do."""

    reason = "blob"


class StoreFull(BlobError):
    """The bucket cannot take the blob; nothing of it was kept."""

    reason = "store_full"


@dataclass(frozen=True, slots=True)
class Chunks:
    """A range of a blob: its bytes, and the cursor of what follows (None at the end)."""

    data: bytes
    cursor: str | None


class BlobStore:
    """The artifact-store's bucket."""

    def __init__(self, js: JetStreamContext, store: ObjectStore, bucket: str) -> None:
        self.js = js
        self.store = store
        self.bucket = bucket
        self.stream = OBJ_STREAM_TEMPLATE.format(bucket=bucket)

    @classmethod
    async def open(
        cls,
        js: JetStreamContext,
        bucket: str = BUCKET,
        replicas: int = 1,
        max_bytes: int | None = None,
    ) -> BlobStore:
        """Bind to the bucket, creating it (file storage) the first time; its size limit is
        set to `max_bytes` (None: none of its own)."""
        try:
            store = await js.object_store(bucket)
        except nats.js.errors.BucketNotFoundError:
            config = js_api.ObjectStoreConfig(
                bucket=bucket,
                description="AgentGrove artifact blobs, named by sha256",
                storage=js_api.StorageType.FILE,
                replicas=replicas,
                max_bytes=max_bytes if max_bytes is not None else -1,
            )
            store = await js.create_object_store(bucket, config=config)
        blobs = cls(js, store, bucket)
        await blobs.limit(max_bytes)
        return blobs

    async def limit(self, max_bytes: int | None) -> None:
        """Set the bucket's size limit (None: none of its own), where it differs."""
        info = await self.js.stream_info(self.stream)
        wanted = max_bytes if max_bytes is not None else -1
        if (info.config.max_bytes or -1) != wanted:
            info.config.max_bytes = wanted
            await self.js.update_stream(info.config)

    async def _info(self, sha256: str) -> Any:
        try:
            return await self.store.get_info(sha256)
        except nats.js.errors.ObjectNotFoundError:
            return None

    async def has(self, sha256: str, size: int) -> bool:
        """Whether the bucket holds this blob whole."""
        info = await self._info(sha256)
        return info is not None and int(info.size or 0) == size

    async def put(self, sha256: str, data: io.BufferedIOBase) -> None:
        """Write a blob (the caller has checked that `data` hashes to `sha256`)."""
        meta = js_api.ObjectMeta(
            name=sha256, options=js_api.ObjectMetaOptions(max_chunk_size=CHUNK_BYTES)
        )
        try:
            await self.store.put(sha256, data, meta=meta)
        except nats.js.errors.APIError as exc:
            if exc.err_code not in FULL_CODES:
                raise
            # nats-py has purged the chunks already written.
            raise StoreFull(
                f"the artifact store is full (bucket {self.bucket}: {exc.description}); nothing "
                "was stored: retry once artifacts are deleted or an operator raises "
                "artifacts.max_store_bytes"
            ) from None

    async def delete(self, sha256: str) -> None:
        """Remove a blob; one already gone is no error."""
        try:
            await self.store.delete(sha256)
        except nats.js.errors.ObjectNotFoundError:
            return

    async def names(self) -> list[str]:
        """The sha256 names of the blobs in the bucket."""
        try:
            infos = await self.store.list(ignore_deletes=True)
        except nats.js.errors.NotFoundError:
            return []
        return [info.name for info in infos if SHA256.fullmatch(info.name or "")]

    async def read(self, sha256: str, cursor: str | None, budget: int) -> Chunks:
        """Whole chunks of a blob from `cursor` (None: the start), at most `budget` bytes
        unless a single chunk is larger."""
        info = await self._info(sha256)
        if info is None:
            raise BlobError(
                f"the blob {sha256} is missing from bucket {self.bucket}; the artifact cannot "
                "be read (its bytes were lost with the bucket)"
            )
        chunks = int(info.chunks or 0)
        if cursor is None:
            seq, index = 1, 0
        else:
            seq, index = self._parse(cursor, info.nuid)
        subject = OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=self.bucket, obj=info.nuid)
        options = info.options
        chunk_size = int(getattr(options, "max_chunk_size", 0) or CHUNK_BYTES)
        out = bytearray()
        while index < chunks and (not out or len(out) + chunk_size <= budget):
            try:
                msg = await self.js.get_msg(self.stream, seq=seq, subject=subject, next=True)
            except nats.js.errors.NotFoundError:
                raise BlobError(
                    f"the blob {sha256} in bucket {self.bucket} has {index} of its {chunks} "
                    "chunks; the artifact cannot be read"
                ) from None
            out += msg.data or b""
            seq = (msg.seq or seq) + 1
            index += 1
        return Chunks(bytes(out), None if index >= chunks else f"{info.nuid}.{seq}.{index}")

    @staticmethod
    def _parse(cursor: str, nuid: str) -> tuple[int, int]:
        parts = cursor.split(".")
        if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
            raise ValueError("'cursor' must be the cursor of the previous answer")
        if parts[0] != nuid:
            raise BlobError(
                "the artifact's blob was rewritten while it was being read; read it again "
                "from offset 0"
            )
        return int(parts[1]), int(parts[2])

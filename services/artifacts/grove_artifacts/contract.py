"""The artifact-store's subjects, for its AsyncAPI document (`make asyncapi`)."""

from __future__ import annotations

from grove_artifacts.service import NAME, ArtifactStore
from grove_core.asyncapi import Channel, Contract, asyncapi_app
from grove_events import ArtifactEvent, ForkEvent, SpawnEvent, kind_wildcard, rpc_subject

#: The request-reply verbs the artifact-store answers on `grove.rpc.artifacts.<verb>`.
VERBS = ("put", "put_chunk", "put_commit", "get", "list", "delete")


def _doc(verb: str) -> str:
    """The verb's request and reply, as its handler documents them."""
    text = getattr(ArtifactStore, verb).__doc__ or ""
    return " ".join(text.split())


CONTRACT = Contract(
    service=NAME,
    description=(
        "Stores artifacts: blobs in the JetStream object store bucket 'grove-artifacts', named "
        "by sha256 (one blob for identical bytes), and an index folded from the log. Reads are "
        "scoped to the asking agent's tree; sizes are limited per artifact and per tree. "
        "Bytes travel base64-encoded, in pieces that fit one NATS message."
    ),
    reads=(
        Channel(
            kind_wildcard("spawn"), "Each agent's tree (a child is in its parent's).", SpawnEvent
        ),
        Channel(kind_wildcard("fork"), "A fork's tree (its source's).", ForkEvent),
        Channel(
            kind_wildcard("artifact"),
            "Its own puts and deletes, folded into the index.",
            ArtifactEvent,
        ),
    ),
    appends=(
        Channel(
            kind_wildcard("artifact"),
            "action=put for every stored artifact, action=delete for every deleted one.",
            ArtifactEvent,
            name="artifacts",
        ),
    ),
    answers=tuple(Channel(rpc_subject(NAME, verb), _doc(verb), name=verb) for verb in VERBS),
)

#: `faststream docs gen grove_artifacts.contract:app`
app = asyncapi_app(CONTRACT)

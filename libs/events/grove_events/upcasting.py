"""Older event shapes are never edited: each kind's old versions are upcast before validation."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

RawEvent = dict[str, Any]
Upcaster = Callable[[RawEvent], RawEvent]


def upcast_status_v1_v2(data: RawEvent) -> RawEvent:
    """status v1 said `status` and a top-level `summary`; v2 has `status_type` and `payload`."""
    out = {k: v for k, v in data.items() if k not in ("status", "summary", "details")}
    out["status_type"] = data.get("status")
    out["payload"] = {"summary": data.get("summary") or "", "details": data.get("details") or {}}
    out["schema_version"] = 2
    return out


#: kind -> {from_version: upcaster to from_version + 1}
UPCASTERS: dict[str, dict[int, Upcaster]] = {
    "status": {1: upcast_status_v1_v2},
}

#: The version each kind is written in today.
CURRENT_VERSIONS: dict[str, int] = {"status": 2}


def current_version(kind: str) -> int:
    """The schema version of `kind` that this code writes."""
    return CURRENT_VERSIONS.get(kind, 1)


def upcast(data: RawEvent) -> RawEvent:
    """Bring a raw event of an older `schema_version` to the current one.

    A missing `schema_version` means the current one: old shapes must say their version.
    """
    kind = data.get("type")
    if not isinstance(kind, str):
        return data
    target = current_version(kind)
    version = data.get("schema_version", target)
    if isinstance(version, bool) or not isinstance(version, int):
        # 2.0 or "2" would pass validation as 2 and skip the upcasters: refuse them here.
        raise TypeError(f"schema_version must be a whole number, not {version!r}")
    if version < 1:
        return data
    if version > target:
        raise ValueError(
            f"{kind} schema_version {version} is newer than this AgentGrove understands "
            f"({target}); upgrade the consumers first"
        )
    steps = UPCASTERS.get(kind, {})
    while version < target:
        data = steps[version](data)
        version = data["schema_version"]
    return data

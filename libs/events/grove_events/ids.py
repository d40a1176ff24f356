"""Identifiers: UUIDv7, time-ordered, as the SDK and services make them."""

from __future__ import annotations

import uuid_utils


def new_id() -> str:
    """A fresh UUIDv7 as a string, ordered after every one made before it in this process.

    uuid-utils makes one in about 0.2 µs; every event appended needs one.
    """
    return str(uuid_utils.uuid7())

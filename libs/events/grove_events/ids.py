"""Identifiers: UUIDv7, time-ordered, as the SDK and services make them."""

from __future__ import annotations

import uuid6


def new_id() -> str:
    """A fresh UUIDv7 as a string."""
    return str(uuid6.uuid7())

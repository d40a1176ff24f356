"""The rows of a folded state: what a fold keeps in memory, and the JSON each row is stored as.

No database here: the SDK and the command line fold the tree with these classes without loading
the projection store (`grove_core.projection`), which imports SQLAlchemy.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Protocol, Self

import orjson

_ATOMS = (str, int, float, bool, type(None))
_ATOM_TYPES = frozenset(_ATOMS)
_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def plain(value: Any) -> Any:
    """A dataclass (or list, tuple, dict of them) as JSON-ready data, like `dataclasses.asdict`
    but without its deep copy of every value: a state writes many rows per second, each
    handed to the database while the fold goes on (so containers are copied, atoms shared).
    """
    kind = type(value)
    if kind in _ATOM_TYPES or isinstance(value, _ATOMS):
        return value
    if kind is list or isinstance(value, list | tuple):
        return [item if type(item) in _ATOM_TYPES else plain(item) for item in value]
    if isinstance(value, dict):
        return {
            key: item if type(item) in _ATOM_TYPES else plain(item) for key, item in value.items()
        }
    names = _FIELD_NAMES.get(kind)
    if names is None:
        if not dataclasses.is_dataclass(value) or isinstance(value, type):
            raise TypeError(f"cannot store a {kind.__name__} in a projection row")
        names = tuple(f.name for f in dataclasses.fields(value))
        _FIELD_NAMES[kind] = names
    row = {}
    for name in names:
        item = getattr(value, name)
        row[name] = item if type(item) in _ATOM_TYPES else plain(item)
    return row


def encode_row(row: Any) -> str:
    """A row (a dataclass record, or JSON-ready data) as JSON text, the form the store keeps.

    orjson writes a dataclass as its fields, like `plain` and `dataclasses.asdict` do, several
    times faster than `plain` followed by `json.dumps`; rows are encoded as they are taken, so
    the fold may change the records at once.
    """
    return orjson.dumps(row).decode()


class FoldState(Protocol):
    """What the runner needs of a service's state: which rows changed, and how to store them."""

    def take_dirty(self) -> dict[str, dict[str, Any] | None]:
        """Rows changed since the last call (key -> JSON-ready row, None = deleted)."""
        ...

    def take_dirty_json(self) -> dict[str, str | None]:
        """The same, each row already encoded as JSON text (what the runner stores)."""
        ...

    @classmethod
    def from_rows(cls, rows: dict[str, dict[str, Any]]) -> Self:
        """Rebuild the state from stored rows."""
        ...


@dataclass
class KeyedState(ABC):
    """A state kept as rows by key, with a record of which keys changed since the last flush.

    Subclasses hold typed records and call `touch(key)` from their fold; `row(key)` gives what
    to store for a key (None when it is gone).
    """

    dirty: set[str] = field(default_factory=set, repr=False, compare=False)

    def touch(self, key: str) -> None:
        """Mark a row as changed."""
        self.dirty.add(key)

    @abstractmethod
    def row(self, key: str) -> Any:
        """What to store for one key: a dataclass record (stored as its fields) or JSON-ready
        data; None when the row is gone. It may be the live record: takers copy or encode it
        at once."""

    def dirty_rows(self) -> dict[str, Any]:
        """The changed rows as `row` gives them, and forget that they changed."""
        out = {key: self.row(key) for key in self.dirty}
        self.dirty.clear()
        return out

    def take_dirty(self) -> dict[str, dict[str, Any] | None]:
        """The changed rows as JSON-ready data, and forget that they changed."""
        return {key: None if row is None else plain(row) for key, row in self.dirty_rows().items()}

    def take_dirty_json(self) -> dict[str, str | None]:
        """The changed rows encoded as JSON text, and forget that they changed."""
        return {
            key: None if row is None else encode_row(row) for key, row in self.dirty_rows().items()
        }

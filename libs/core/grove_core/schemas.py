"""Export the JSON Schema of every event kind to `docs/schemas/<kind>.json`.

`python -m grove_core.schemas DIR` writes them; with `--check` it fails when any file differs
from what the code would write, so CI catches stale schemas.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from grove_events import EVENT_CLASSES


def render(kind: str) -> str:
    """The JSON Schema document of one kind, as written to disk."""
    schema = EVENT_CLASSES[kind].model_json_schema(by_alias=True, mode="validation")
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["$id"] = f"https://agentgrove.dev/schemas/{kind}.json"
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write or check the schema files."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("directory", type=Path)
    parser.add_argument("--check", action="store_true", help="fail when a file is stale")
    args = parser.parse_args(argv)
    stale = []
    args.directory.mkdir(parents=True, exist_ok=True)
    for kind in EVENT_CLASSES:
        path = args.directory / f"{kind}.json"
        text = render(kind)
        current = path.read_text() if path.exists() else None
        if current == text:
            continue
        if args.check:
            stale.append(str(path))
        else:
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print(
            "stale JSON Schema files (run `make schemas` and commit): " + ", ".join(stale),
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

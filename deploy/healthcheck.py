"""Container health check: GET each path on the service's HTTP port; exit 1 unless all are 200.

Usage: `python healthcheck.py /healthz /readyz` (default `/healthz`). The port is
GROVE_HTTP_PORT (default 8080).
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request


def check(paths: list[str], port: str) -> int:
    """0 when every path answers 200 on 127.0.0.1:`port`, else 1."""
    for path in paths:
        url = f"http://127.0.0.1:{port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=3) as response:
                if response.status != 200:
                    print(f"{url}: HTTP {response.status}", file=sys.stderr)
                    return 1
        except (urllib.error.URLError, OSError) as exc:
            print(f"{url}: {exc}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(check(sys.argv[1:] or ["/healthz"], os.environ.get("GROVE_HTTP_PORT", "8080")))

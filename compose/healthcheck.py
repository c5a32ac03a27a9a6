#!/usr/bin/env python3
"""The image's HEALTHCHECK: GET $TANDEM_HEALTH_URL (a service's readiness URL) and exit 0 on
a 2xx answer, 1 otherwise. Without the variable (workers, orchestrator: no HTTP port) the
container is healthy while its process runs. Standard library only."""

import os
import sys
import urllib.request


def main() -> int:
    url = os.environ.get("TANDEM_HEALTH_URL", "")
    if not url:
        return 0
    try:
        with urllib.request.urlopen(url, timeout=2.5) as reply:
            return 0 if 200 <= reply.status < 300 else 1
    except Exception as error:  # noqa: BLE001 - any failure is "unhealthy"
        print(f"{url}: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

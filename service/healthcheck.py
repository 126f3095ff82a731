"""``python -m service.healthcheck``: exit 0 when this host's service answers ``/readyz`` with 200.

For container health checks, without curl: the port is ``KDEQ_PORT`` (default 8000).
"""

import os
import sys
import urllib.error
import urllib.request


def main() -> int:
    url = f"http://127.0.0.1:{os.environ.get('KDEQ_PORT', '8000')}/readyz"
    try:
        with urllib.request.urlopen(url, timeout=4) as response:
            return 0 if response.status == 200 else 1
    except (urllib.error.URLError, OSError) as err:
        print(f"{url}: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())

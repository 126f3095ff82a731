"""``python -m service``: the same as ``kdeq serve``."""

from service.server import main

raise SystemExit(main())

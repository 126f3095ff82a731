"""``python -m service``: the same as ``kdeq serve``."""

from service.cli import main

raise SystemExit(main())

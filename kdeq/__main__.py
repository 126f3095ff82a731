from kdeq.cli import main

raise SystemExit(main())

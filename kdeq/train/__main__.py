import sys

from kdeq.train.cli import main

sys.exit(main())

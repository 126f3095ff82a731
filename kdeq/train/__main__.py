import os
import sys

from kdeq.train.cli import main

code = main()
if int(os.environ.get("WORLD_SIZE", "1")) > 1:
    # under torchrun, the interpreter's teardown can abort a rank after its work is done and written
    # ("terminate called without an active exception": a C++ thread of the distributed backend still
    # joinable at exit, seen in tests/test_distributed.py about once in a dozen launches under load);
    # every file is closed by now, so flush the streams and leave without that teardown
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
sys.exit(code)

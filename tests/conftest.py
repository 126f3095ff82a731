import os
from collections.abc import Iterator

import pytest
import torch

from kdeq.runtime import native
from tests.helpers import require_native

# The guide networks run in float32 throughout the suite, as training runs them (a developer's own
# setting stands): its tests compare pilots and solves to 1e-5 and closer, which bfloat16, where
# kdeq.runtime.netprecision measures it faster, does not meet. tests/test_netprecision.py measures that
# choice and bounds what it costs a real checkpoint; the service processes the tests start inherit this.
os.environ.setdefault("KDEQ_NETWORK_PRECISION", "float32")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Torch on one thread for a module of small tensors (``pytestmark = usefixtures("one_thread")``):
    intra-op threads add only synchronisation there, which on a busy machine costs several times the
    work itself; restored after the module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=["loop", "native"])
def guided_backend(request: pytest.FixtureRequest) -> Iterator[str]:
    """A test on each implementation of the guided kernel's offset loops on the CPU: torch's
    operations, and ``kdeq.runtime.native``'s compiled C (skipped where no C compiler builds it)."""
    if request.param == "native":
        require_native()
    with native.choice.force(request.param):
        yield request.param


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--soak-seconds",
        type=float,
        default=60.0,
        help="duration of the soak test (CI: 60 s; longer by flag)",
    )

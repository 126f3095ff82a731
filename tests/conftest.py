from collections.abc import Iterator

import pytest
import torch


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


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--soak-seconds",
        type=float,
        default=60.0,
        help="duration of the soak test (CI: 60 s; longer by flag)",
    )

import pytest

from tests.harness import WORLD_SIZES


@pytest.fixture(params=WORLD_SIZES, ids=lambda n: f"world{n}")
def world_size(request) -> int:
    """Run a distributed test on 1, 2 and 3 processes."""
    return request.param

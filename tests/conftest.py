import pytest

from tests.harness import WORLD_SIZES


@pytest.fixture(params=WORLD_SIZES, ids=lambda n: f"world{n}")
def world_size(request) -> int:
    """Run a distributed test on 1, 2 and 3 processes."""
    return request.param


@pytest.fixture
def needs_cluster():
    """Simulated hosts (network namespaces) need root; skip with the reason when unavailable,
    and fail a test that leaves namespaces behind."""
    from gradsync.bench.cluster import available, list_namespaces

    reason = available()
    if reason is not None:
        pytest.skip(reason)
    yield
    assert list_namespaces() == [], "a test left network namespaces behind"

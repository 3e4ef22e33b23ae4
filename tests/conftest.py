import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.harness import WORLD_SIZES


# `make test` hands whole files to its workers in collection order, the next file to whichever
# worker is free. The longest files go first (longest-first is the classic greedy for balancing
# jobs across machines): the zoo's session fixture launches ~45 jobs (over 300 s), the script
# checks' ~20 each; collected late, as their paths sort, they ran while the other workers had
# little or nothing left. Measured with --durations on 2 cores, 2026-12-04.
STARTED_FIRST = (
    "tests/run/test_zoo.py",
    "tests/run/test_doctor_script.py",
    "tests/run/test_doctor_consistency.py",
    "tests/checkpoint/test_chaos.py",
    "tests/run/test_faults.py",
    "tests/parallel/test_checkpoints.py",
    "tests/bench/test_train.py",
    "tests/cli/test_demo.py",
    "tests/checkpoint/test_resume.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    order = {path: index for index, path in enumerate(STARTED_FIRST)}
    items.sort(key=lambda item: order.get(item.nodeid.split("::")[0], len(order)))  # stable: the rest keep their order


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


@dataclass
class DemoRun:
    run_dir: Path
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory) -> DemoRun:
    """One `gradsync demo` (the main job, ~25 s here), shared by the demo's and the report's tests."""
    scratch = tmp_path_factory.mktemp("demo")
    done = subprocess.run(
        [str(Path(sys.executable).parent / "gradsync"), "demo", "--run-dir", str(scratch / "run")],
        cwd=scratch, capture_output=True, text=True, timeout=180,
    )
    return DemoRun(scratch / "run", done.returncode, done.stdout, done.stderr)

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

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

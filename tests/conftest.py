import contextlib
import multiprocessing.forkserver
import multiprocessing.process
import multiprocessing.resource_tracker
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import psutil
import pytest

from tests.harness import WORLD_SIZES
from tests.once_per_run import once_per_run


# `make test` hands whole files to its workers in collection order (--no-loadscope-reorder), the
# next file to whichever worker is free; each worker holds one file queued behind the one it runs.
# The longest files go first (longest-first is the classic greedy for balancing jobs across
# machines); collected late, as their paths sort, they ran while the other workers had little or
# nothing left. Ordered by their wall time in a 3-worker run on 2 cores, 2026-12-05, the zoos'
# files by what they take now that they launch only the scripts their tests need launched.
STARTED_FIRST = (
    "tests/cli/test_demo.py",
    "tests/parallel/test_checkpoints.py",
    "tests/bench/test_train.py",
    "tests/checkpoint/test_resume.py",
    "tests/run/test_zoo.py",
    "tests/checkpoint/test_chaos.py",
    "tests/comm/test_compression.py",
    "tests/report/test_report.py",
    "tests/doctor/test_cli.py",
    "tests/parallel/test_strategies.py",
    "tests/run/test_faults.py",
    "tests/test_bucket_layout.py",
    "tests/comm/test_periodic.py",
    "tests/bench/test_allreduce.py",
    "tests/test_host_memory.py",
    "tests/run/test_doctor_script.py",
    "tests/test_accumulation.py",
    "tests/comm/test_auto_on_links.py",
    "tests/checkpoint/test_elastic.py",
    "tests/run/test_doctor_consistency.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    order = {path: index for index, path in enumerate(STARTED_FIRST)}
    items.sort(key=lambda item: order.get(item.nodeid.split("::")[0], len(order)))  # stable: the rest keep their order


# `make test-fast` runs the tests that stay inside pytest's own process: unit tests, and single-process
# tests of real objects (a TCPStore, a world-size-1 process group). A test that starts processes (ranks,
# launchers, CLIs, DataLoader workers) is marked `launches` and left to `make test`. Under
# --in-process an unmarked test that starts one fails, naming the marker, so the fast tier cannot
# silently grow slow tests; `make test` runs everything, guard off.
IN_PROCESS_OPTION = "--in-process"
_REFUSED = pytest.StashKey[bool]()


class StartsAProcess(Exception):
    """Raised where an unmarked test starts a process under --in-process."""


# tests/run/test_zoo.py: which zoo scripts are launched. "recorded": those the tests need launched,
# the others re-diagnosed from their recordings (make test); "live": every one (make test-zoo);
# "record": every one, and their recordings written again (make zoo-record).
ZOO_OPTION = "--zoo"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(IN_PROCESS_OPTION, action="store_true",
                     help="fail any test not marked `launches` that starts a process (make test-fast)")
    parser.addoption(ZOO_OPTION, choices=("recorded", "live", "record"), default="recorded",
                     help="zoo scripts: launch those the tests need and re-diagnose the rest from their "
                          "recordings (recorded), launch all (live), or launch all and record them again (record)")


def _refusal(item: pytest.Item) -> str:
    return (f"{item.nodeid} starts a process: mark it @pytest.mark.launches (it then runs in `make test`, "
            "not in `make test-fast`)")


@contextlib.contextmanager
def _no_new_processes(item: pytest.Item) -> Iterator[None]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        item.stash[_REFUSED] = True  # code under test may catch the error; the test fails all the same
        raise StartsAProcess(_refusal(item))

    patches = [(subprocess.Popen, "_execute_child"), (multiprocessing.process.BaseProcess, "start"),
               (os, "fork"), (os, "system"), (os, "posix_spawn"), (os, "posix_spawnp")]
    saved = [(owner, name, getattr(owner, name)) for owner, name in patches]
    for owner, name, _ in saved:
        setattr(owner, name, refuse)
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def pytest_sessionstart(session: pytest.Session) -> None:
    """matplotlib builds its font cache the first time it is imported on a machine, and runs
    `fc-list` for it: on a fresh machine the first test that draws would be refused under
    --in-process for what a library does once per machine. It is built here, outside every test."""
    if session.config.getoption(IN_PROCESS_OPTION):
        with contextlib.suppress(ImportError):
            import matplotlib.font_manager  # noqa: F401


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Under --in-process, the guard covers the test's setup (session fixtures included), call and
    teardown. After every test, what it left running is ended (see _end_leftovers)."""
    guarded = item.config.getoption(IN_PROCESS_OPTION) and item.get_closest_marker("launches") is None
    with _no_new_processes(item) if guarded else contextlib.nullcontext():
        yield
    _end_leftovers(item.nodeid)


# A test that gives up on a launcher (`subprocess.run(..., timeout=...)` kills it) leaves its
# workers running: torchrun starts each in a session of its own, so they outlive it, blocked on a
# store that is gone. Seen on a loaded machine: two ranks of a timed-out `gradsync run` still
# waiting 40 minutes later, taking CPU from every test after them. Every process a pytest process
# starts inherits its PID in this variable (which nothing under test reads), however far it
# drifts from its parent; what a test left running is ended when the test is over. (Not as a
# subreaper: orphans would then stay unreaped zombies of pytest for the rest of the test, which
# changes what `psutil.wait_procs` and `os.kill(pid, 0)` tell the code under test.)
STARTED_BY = "GRADSYNC_TESTS_STARTED_BY"


def pytest_configure(config: pytest.Config) -> None:
    os.environ[STARTED_BY] = str(os.getpid())
    # Run inside a Slurm allocation (salloc, an sbatch test job), every gradsync the tests start
    # would read that allocation (the doctor's Slurm checks): the suite judges gradsync, not the
    # job it happens to run in. Tests of the Slurm checks set their own SLURM_* variables.
    for name in [name for name in os.environ if name.startswith("SLURM_") or name == "SLURMD_NODENAME"]:
        del os.environ[name]


def _end_leftovers(nodeid: str) -> None:
    """Kill every process this pytest process started that is still running, but the long-lived
    helpers the next tests reuse: the harness's forkserver and multiprocessing's resource tracker."""
    keep = {os.getpid(), multiprocessing.forkserver._forkserver._forkserver_pid,
            multiprocessing.resource_tracker._resource_tracker._pid}
    ours = str(os.getpid())
    left: dict[psutil.Process, str] = {}
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error):  # gone, a zombie, or not ours to read
            if process.pid not in keep and process.environ().get(STARTED_BY) == ours:
                left[process] = " ".join(process.cmdline())[:100]
    for process in left:
        with contextlib.suppress(psutil.Error):
            process.kill()
    psutil.wait_procs(list(left), timeout=10)
    if left:
        print(f"\n{nodeid} left {len(left)} process(es) running, ended: " + "; ".join(left.values()),
              file=sys.__stderr__, flush=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if item.stash.get(_REFUSED, False) and not report.skipped:
        item.stash[_REFUSED] = False  # the phase the refusal came in reports it, once
        if report.passed:  # the code under test swallowed it
            report.outcome = "failed"
            report.longrepr = _refusal(item)


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
    """One `gradsync demo` (the main job, ~25 s here), shared by the demo's and the report's tests
    (which copy its run folder before they change anything in it)."""

    def demo(scratch: Path) -> DemoRun:
        done = subprocess.run(
            [str(Path(sys.executable).parent / "gradsync"), "demo", "--run-dir", str(scratch / "run")],
            cwd=scratch, capture_output=True, text=True, timeout=180,
        )
        return DemoRun(scratch / "run", done.returncode, done.stdout, done.stderr)

    return once_per_run(tmp_path_factory, "demo", demo)

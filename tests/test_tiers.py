"""The fast tier's guard (tests/conftest.py): under --in-process, a test that starts a process
fails unless marked `launches`, even when the code under test swallows the refusal; marked
tests are the ones `make test-fast` leaves out; without the option nothing is refused."""

import textwrap

import pytest

from tests.harness import REPO_ROOT

pytest_plugins = ["pytester"]

# Each case runs in a pytest of its own (a subprocess), with the suite's conftest hooks.
pytestmark = pytest.mark.launches

CASES = '''
    import subprocess
    import sys

    import pytest


    def _start():
        subprocess.run([sys.executable, "-c", "pass"], check=True)


    def test_unmarked_starts_a_process():
        _start()


    def test_unmarked_swallows_the_refusal():
        try:
            _start()
        except Exception:
            pass


    @pytest.mark.launches
    def test_marked_starts_a_process():
        _start()


    def test_in_process():
        assert sum(range(4)) == 6
'''


@pytest.fixture
def cases(pytester):
    pytester.makeconftest(f"import sys\nsys.path.insert(0, {str(REPO_ROOT)!r})\nfrom tests.conftest import *  # noqa: F401,F403\n")
    pytester.makeini("[pytest]\nmarkers =\n    launches: starts processes\n")
    pytester.makepyfile(test_cases=textwrap.dedent(CASES))
    return pytester


def test_under_in_process_an_unmarked_test_that_starts_a_process_fails_naming_the_marker(cases):
    result = cases.runpytest_subprocess("--in-process", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=2)
    result.stdout.fnmatch_lines(["*test_unmarked_starts_a_process starts a process: mark it @pytest.mark.launches*"])
    assert "FAILED test_cases.py::test_unmarked_swallows_the_refusal" in result.stdout.str()


def test_the_fast_tier_leaves_marked_tests_out_and_the_whole_suite_refuses_nothing(cases):
    cases.runpytest_subprocess("--in-process", "-m", "not launches", "-k", "not unmarked", "-p", "no:cacheprovider").assert_outcomes(
        passed=1, deselected=3)
    cases.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=4)

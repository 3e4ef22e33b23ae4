"""The order `make test` starts its files in (tests/conftest.py) names files that exist: a file
renamed or moved would silently fall back to its place by path, late, and lengthen the run."""

from pathlib import Path

from tests.conftest import STARTED_FIRST

ROOT = Path(__file__).parent.parent


def test_every_file_started_first_exists_once():
    assert [path for path in STARTED_FIRST if not (ROOT / path).is_file()] == []
    assert len(set(STARTED_FIRST)) == len(STARTED_FIRST)


def test_make_test_hands_out_files_in_that_order():
    # pytest-xdist reorders whole-file work by each file's number of tests unless told not to,
    # which put the longest few-test files last (2026-12-05: chaos, the bench and the demos ran
    # alone after everything else).
    recipe = (ROOT / "Makefile").read_text().split("\ntest: ", 1)[1].split("\n\n", 1)[0]
    assert "--dist loadfile" in recipe and "--no-loadscope-reorder" in recipe, recipe

"""The order `make test` starts its files in (tests/conftest.py) names files that exist: a file
renamed or moved would silently fall back to its place by path, late, and lengthen the run."""

from pathlib import Path

from tests.conftest import STARTED_FIRST

ROOT = Path(__file__).parent.parent


def test_every_file_started_first_exists_once():
    assert [path for path in STARTED_FIRST if not (ROOT / path).is_file()] == []
    assert len(set(STARTED_FIRST)) == len(STARTED_FIRST)

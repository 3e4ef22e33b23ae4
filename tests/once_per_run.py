"""A session fixture's value made once per pytest run, not once per xdist worker.

pytest-xdist gives every worker its own session, so a session fixture that tests in two files use
is made by each worker that runs one of them: `make test` launched the demo twice, and the
checkpoint tests' uninterrupted reference up to four times. The first worker to ask makes the value
and leaves it, pickled, in the folder the workers' temporary folders share; the others wait for
it under a file lock and read it.
"""

from __future__ import annotations

import fcntl
import os
import pickle
from pathlib import Path
from typing import Callable, TypeVar

import pytest

T = TypeVar("T")


def once_per_run(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], T]) -> T:
    """`make(folder)`, called once per pytest run; `folder` is kept for the run's other workers."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # each worker's basetemp is a folder of this one
    folder = root / f"once-{name}"
    with open(root / f"once-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        made = folder / "value.pickle"
        if made.exists():
            return pickle.loads(made.read_bytes())
        folder.mkdir(exist_ok=True)
        value = make(folder)
        made.write_bytes(pickle.dumps(value))
        return value

"""A scenario run twice in pytest's own process, as a plain script and under gradsync's hooks, and
what the script saw each time: for the tests that gradsync's failures never become the script's
(gradsync.run.harmless)."""

from __future__ import annotations

import contextlib
import os
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist

import gradsync.run


@contextlib.contextmanager
def gloo_world(folder: Path) -> Iterator[None]:
    """A world-size-1 Gloo group in this process, on a FileStore of its own in `folder` (made here)."""
    folder.mkdir(parents=True)
    dist.init_process_group("gloo", store=dist.FileStore(str(folder / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        if dist.is_initialized():
            # While this thread waits, Gloo's threads drop their last works with the GIL, before
            # the group goes (tests/run/zoo/README.md, "A Gloo process can abort at exit").
            dist.barrier()
            dist.destroy_process_group()


_GRADSYNC = os.path.dirname(os.path.dirname(os.path.abspath(gradsync.run.__file__))) + os.sep


def outcome(scenario: Callable[[], Any]) -> tuple:
    """What the script saw: ("returned", result) or ("raised", type, message, file, line), the file
    and line of the innermost frame outside gradsync (whose frames a worker leaves out of the
    tracebacks it shows). The script's own exception has the same one with or without gradsync's
    wrappers around the call; an exception of gradsync's bookkeeping has another."""
    try:
        return ("returned", scenario())
    except Exception as error:
        frames = [f for f in traceback.extract_tb(error.__traceback__) if not os.path.abspath(f.filename).startswith(_GRADSYNC)]
        return ("raised", type(error).__name__, str(error), os.path.basename(frames[-1].filename), frames[-1].lineno)


def gradsync_warnings(err: str) -> list[str]:
    """gradsync's warnings in what rank 0 wrote to stderr, each checked to be rank-prefixed."""
    found = [line for line in err.splitlines() if "gradsync run: warning:" in line]
    assert all(line.startswith("[gradsync rank 0] gradsync run: warning: ") for line in found), found
    return found

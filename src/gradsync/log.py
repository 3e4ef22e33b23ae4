"""Rank-prefixed logging: summaries from rank 0, warnings and errors from every rank."""

from __future__ import annotations

import logging
import sys

_LOGGER = logging.getLogger("gradsync")


class _CurrentStderr(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a record is emitted: notebooks and test runners
    replace it, and a handler holding the old one would write to a closed stream."""

    @property  # type: ignore[override]
    def stream(self):  # type: ignore[no-untyped-def]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # type: ignore[no-untyped-def]
        pass


def rank_prefix(rank: int | str) -> str:
    """What starts each of gradsync's lines on a rank's stderr."""
    return f"[gradsync rank {rank}] "


def configure_logging(rank: int) -> logging.Logger:
    """The gradsync logger for this rank: INFO on rank 0, WARNING and above on the others."""
    if not _LOGGER.handlers:
        _LOGGER.addHandler(_CurrentStderr())
        _LOGGER.propagate = False
    for handler in _LOGGER.handlers:
        handler.setFormatter(logging.Formatter(rank_prefix(rank) + "%(message)s"))
    _LOGGER.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    return _LOGGER

"""Do no harm: gradsync's hooks run inside the user's own calls, and their failures must stay theirs.

Every hook `gradsync run` installs into a rank (the collective wrappers, DDP's patches, the
backward and optimizer wrappers, the script check's watches) does two things: the user's call,
which runs exactly once, its result returned and its exception raised as they are; and
gradsync's bookkeeping around it (records, a group's ranks, fingerprints, the user's line, file
writes). The bookkeeping meets whatever the script does: a process group the script destroyed,
objects that cannot be fingerprinted, a full disk, a torch that changed. None of that may turn
into an exception the script would not have raised (a user once got gradsync's KeyError out of
`loss.backward()`, where plain torchrun failed with the script's own ValueError further on).

So each hook runs its bookkeeping inside a `Bookkeeping` of its kind: an Exception there is
said once per kind on the rank's stderr (its console and log) and swallowed, and the hook does
what the script would have done without gradsync for that call (the record is missing, never
wrong). The user's call stays outside: what it raises goes on unchanged. KeyboardInterrupt and
SystemExit are not the hook's failures and pass.
"""

from __future__ import annotations

import os
import sys
import traceback
import weakref
from types import TracebackType

from gradsync.log import rank_prefix

_GRADSYNC = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _where(error: BaseException) -> str:
    """file:line where gradsync's own code raised `error` (else the innermost frame's)."""
    frames = traceback.extract_tb(error.__traceback__)
    ours = [frame for frame in frames if os.path.abspath(frame.filename).startswith(_GRADSYNC)]
    frame = (ours or frames or [None])[-1]
    return f"{os.path.basename(frame.filename)}:{frame.lineno}" if frame is not None else "?"


class Bookkeeping:
    """The bookkeeping of one kind of hook: `with bookkeeping: ...` swallows an Exception raised
    inside, after saying the first one on stderr. Reusable and reentrant (it keeps no state of a
    call), so a hook makes one and enters it on every call."""

    __slots__ = ("hook", "failure")

    def __init__(self, hook: str) -> None:
        self.hook = hook  # what failed, as the warning names it: "the collective recorder's backward hook"
        self.failure: str | None = None  # the first failure, once said

    def __enter__(self) -> Bookkeeping:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None) -> bool:
        if not isinstance(error, Exception):
            return False  # none, or KeyboardInterrupt / SystemExit: not the hook's to stop
        self._failed(error)
        return True

    def _failed(self, error: Exception) -> None:
        if self.failure is not None:
            return
        self.failure = f"{type(error).__name__}: {exception_text(error)}"[:300]
        try:
            print(f"{rank_prefix(os.environ.get('RANK', '0'))}gradsync run: warning: {self.hook} failed "
                  f"({self.failure}, at {_where(error)}); it steps aside wherever it fails, and the script runs as "
                  "without gradsync (said once)", file=sys.stderr, flush=True)
        except Exception:  # noqa: BLE001 - a closed stderr, an unreadable traceback: the warning is lost, never raised
            pass


def exception_text(error: BaseException) -> str:
    """str(error), or the placeholder Python's traceback prints for an exception whose __str__ fails."""
    try:
        return str(error)
    except Exception:  # noqa: BLE001 - the user's exception class, whatever its __str__ raises
        return "<exception str() failed>"


class BookkeepingByKind(dict[str, Bookkeeping]):
    """One Bookkeeping per kind of hook, made on first use: each kind says its first failure once."""

    def __missing__(self, hook: str) -> Bookkeeping:
        bookkeeping = self[hook] = Bookkeeping(hook)
        return bookkeeping

    def failures(self) -> dict[str, str]:
        """hook -> its first failure, for the kinds that failed."""
        return {hook: bookkeeping.failure for hook, bookkeeping in self.items() if bookkeeping.failure is not None}


class IdentityMap:
    """What gradsync keeps about the script's objects, kept beside them, never on them.

    An attribute or a hook on a user's model holds gradsync's bookkeeping (and through it a
    process group) wherever the model goes: a `copy.deepcopy(ddp)` for an EMA teacher or a
    `pickle` of it then fails with "cannot pickle ProcessGroup", where plain torchrun's run goes
    on. So a watch's record of an object lives here, keyed by the object's identity (a module
    class may define `__eq__` without `__hash__`, so weak dictionaries cannot key it) and
    dropped when the object dies (its id may then be reused)."""

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, object]] = {}

    def __setitem__(self, key: object, value: object) -> None:
        entries, ident = self._entries, id(key)
        self._entries[ident] = (weakref.ref(key, lambda _, ident=ident: entries.pop(ident, None)), value)

    def get(self, key: object, default: object = None) -> object:
        entry = self._entries.get(id(key))
        return entry[1] if entry is not None and entry[0]() is key else default

    def __contains__(self, key: object) -> bool:
        entry = self._entries.get(id(key))
        return entry is not None and entry[0]() is key

    def __len__(self) -> int:
        return len(self._entries)

    def __bool__(self) -> bool:
        return bool(self._entries)

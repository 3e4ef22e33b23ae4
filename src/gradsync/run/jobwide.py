"""The job-wide view: every node's launcher publishes its ranks' positions where the others can read them.

Why: without a shared file system a node's monitor sees only the files of the ranks it runs, so a
`barrier` inside `if rank == 0:` looks, from each side, like one rank waiting on a network that
does not deliver. Every node of a multi-host job already reaches one store: the rendezvous
TCPStore that node 0's elastic agent serves (static rendezvous: --master-addr/--master-port;
c10d: --rdzv-endpoint). The launchers put their ranks' compact state there, under
`gradsync/<rdzv id>/<round>/rank<R>`, and read the others' when a diagnosis may be coming, so
each node's verdict names every rank with its line. Nothing new to serve, no port to open, no
shared folder.

Bounds, so that it scales: what one rank publishes is trimmed (the newest ring records, stack
frames, CRC checkpoints and Flight Recorder entries; long lists and texts cut) and compressed to at
most MAX_RANK_BYTES; a node publishes a rank only when its state changed, at most once per
snapshot interval (an exit record or a stop at once); it reads the other ranks only when a
diagnosis may be coming (its own ranks idle for a while, one of them just ended, the attempt
over), and to tell whether the job is stuck it stops at the first rank that progresses. The store
may go away at any time (node 0's agent ends with its job): the board never raises, never waits
more than about a second, retries later, and keeps what it last read. So that the last states
reach every node, each node's agent, once it finds its workers ended, publishes how they ended
(the exit code and signal it saw: "agent_exit"), reads the others' ends and says so (`done`);
node 0's agent waits a few seconds at most for every node to have said so before its store goes.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import json
import os
import socket
import threading
import time
import zlib
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Union

import torch
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from gradsync.rundir import read_json, write_json

# Which workers' states belong together: those of one rendezvous round, named by the store its
# workers share ("10.0.0.1:29517", a new one every round), or an attempt number where the ranks
# do not say. Not the attempt alone: each node numbers its own attempts (a node that came back,
# or joined an elastic job late, counts from 0 while the others are further on).
RoundKey = Union[str, int]
MAX_RANK_BYTES = 32 * 1024  # one rank's published state, compressed
OP_TIMEOUT_S = 0.5  # one store request
READ_BUDGET_S = 1.0  # one read of the other ranks; what it did not get, the next one does
CONNECT_TIMEOUT_S = 0.3  # the TCP connect that checks the store is there
HANDSHAKE_TIMEOUT_S = 0.7  # TCPStore's own connect and handshake, on a thread of its own
RETRY_AFTER_S = 5.0  # after the store could not be reached
READ_BATCH = 32  # keys per multi_get: one request stays within 1 MB
# Tighter and tighter trims, tried in turn until the state fits MAX_RANK_BYTES.
_TRIMS = (
    {"records": 32, "frames": 16, "checkpoints": 32, "flight": 64, "items": 256, "text": 4000},
    {"records": 16, "frames": 8, "checkpoints": 8, "flight": 16, "items": 64, "text": 1000},
    {"records": 4, "frames": 4, "checkpoints": 2, "flight": 4, "items": 16, "text": 200},
)
# What a rank's state keeps when nothing else fits: who it is, where it was, how it ended.
_ESSENTIALS = (
    "rank", "local_rank", "world_size", "local_world_size", "attempt", "host", "pid", "started", "target",
    "time", "phase", "last_progress", "location", "backward_passes", "nonfinite_passes", "collectives",
    "agent_exit",
)
# What the monitor reads of every rank's state, for its stall rule.
_REQUIRED = ("rank", "pid", "time", "last_progress")
_DEFAULT_PORTS = {"static": 29500, "c10d": 29400}
_MAX_GROUPS = 64
_MAX_MEMBERS = 1024  # an irregular member list longer than this is left out (readers take every rank)


@dataclass(frozen=True)
class StoreAddress:
    """Where the rendezvous store of a multi-node job listens, and the job's rendezvous id."""

    host: str
    port: int
    run_id: str

    def write(self, path: Path) -> None:
        """Kept in the run folder, for `gradsync status` and `gradsync stacks` (RunDir.job_board)."""
        write_json(path, asdict(self))

    @classmethod
    def read(cls, path: Path) -> StoreAddress | None:
        data = read_json(path)
        if not isinstance(data, dict) or not all(isinstance(data.get(k), t) for k, t in (("host", str), ("port", int), ("run_id", str))):
            return None
        return cls(data["host"], data["port"], data["run_id"])


def round_of(attempt: int, *by_rank: Mapping[int, Mapping[str, Any]]) -> RoundKey:
    """Where a node's ranks of `attempt` (their states, rank -> snapshot or exit record) meet the
    other nodes' on the job board: their rendezvous round (each node numbers its own attempts),
    or the attempt where they do not say."""
    for states in by_rank:
        for state in states.values():
            if state.get("round_store"):
                return state["round_store"]
    return attempt


def world_size_of(states: Mapping[int, Mapping[str, Any]]) -> int:
    """The job's world size as its ranks' states (rank -> snapshot or exit record) say it."""
    return max(state.get("world_size", 1) for state in states.values())


def rendezvous_store(args: argparse.Namespace) -> StoreAddress | None:
    """The TCPStore torchrun's agents share, from torchrun's options as given (before torch's
    `run` rewrites them); None when the job has one node (--standalone, --nnodes 1) or a
    rendezvous backend that is not a TCPStore (etcd): there is no other node to hear from."""
    if args.standalone or args.rdzv_backend not in _DEFAULT_PORTS:
        return None
    if int(str(args.nnodes).split(":")[-1]) <= 1:
        return None
    endpoint = args.rdzv_endpoint
    if args.rdzv_backend == "static" and not endpoint:
        endpoint = f"{args.master_addr}:{args.master_port or _DEFAULT_PORTS['static']}"
    if not endpoint:
        return None
    host, port = parse_rendezvous_endpoint(endpoint, default_port=_DEFAULT_PORTS[args.rdzv_backend])
    return StoreAddress(host, port, str(args.rdzv_id))


class _Published(NamedTuple):
    data: bytes
    ending: tuple[bool, bool, bool]  # whether it had exited, whether this node had stopped it, whether its agent saw it end
    when: float  # time.monotonic()


class _Read(NamedTuple):
    state: dict[str, Any]
    when: float  # time.time() of the read


def _due(cached: dict[int, _Read], ranks: set[int], older_than: float) -> list[int]:
    """The ranks not read since `older_than`: the most recently active first (the likeliest to
    show that the job is not stuck), then those never read."""

    def order(rank: int) -> tuple[bool, float]:
        seen = cached.get(rank)
        return (seen is None, 0.0 if seen is None else -float(seen.state.get("last_progress") or 0.0))

    return sorted((rank for rank in ranks if rank not in cached or cached[rank].when < older_than), key=order)


class JobBoard:
    """This node's window on the other nodes' ranks, through the rendezvous store.

    `publish` puts this node's ranks' states; `read` returns the others', each marked "remote"
    (its PID names a process on another host). Both are best effort: when the store cannot be
    reached they do nothing and `read` answers what it read last. The monitor's thread and the
    launcher's (diagnosing an attempt the agent restarts) may use it at once: one at a time.
    """

    def __init__(self, address: StoreAddress, interval_s: float):
        self.address = address
        self.interval_s = interval_s
        self.prefix = f"gradsync/{address.run_id}"
        self._lock = threading.Lock()
        self._store: TCPStore | None = None
        self._connecting: threading.Thread | None = None
        self._retry_at = 0.0
        self._published: dict[tuple[RoundKey, int], _Published] = {}  # (round_key, rank) -> what was put last
        self._present: dict[RoundKey, set[int]] = {}  # round -> ranks known to have published
        self._cache: dict[RoundKey, dict[int, _Read]] = {}  # round -> rank -> its state as last read

    # -- publishing --

    def publish(self, round_key: RoundKey, states: Mapping[int, dict[str, Any]], stopped: set[int]) -> None:
        """Publish the states (rank -> exit record, else snapshot) of this node's ranks that
        changed; `stopped`: the ranks this node's launcher stopped. A rank is republished at most
        once per interval, unless it just exited, was stopped or its agent saw it end (others
        must learn that before the store may go)."""
        with self._lock, _quiet_c10d():
            self._publish(round_key, states, stopped)

    def _publish(self, round_key: RoundKey, states: Mapping[int, dict[str, Any]], stopped: set[int]) -> None:
        now = time.monotonic()
        keys, values, changed = [], [], []  # changed: (rank, ending)
        for rank, state in states.items():
            ending = ("exit" in state, rank in stopped, "agent_exit" in state)
            last = self._published.get((round_key, rank))
            if last is not None and now - last.when < self.interval_s and ending == last.ending:
                continue
            data = compact_state(state, stopped=rank in stopped)
            if last is not None and data == last.data:
                continue
            keys.append(self._key(round_key, rank))
            values.append(data)
            changed.append((rank, ending))
        if not keys:
            return
        unindexed = "".join(f"{rank}," for rank, _ in changed if (round_key, rank) not in self._published)
        store = self._connected()
        if store is None:
            return
        try:
            store.multi_set(keys, values)
            if unindexed:
                store.append(self._index_key(round_key), unindexed)
        except Exception:  # the store went away or did not answer in time
            self._disconnect()
            return
        for (rank, ending), data in zip(changed, values):
            self._published[(round_key, rank)] = _Published(data, ending, now)

    # -- reading --

    def read(self, round_key: RoundKey, world_size: int, local: set[int], max_age_s: float, not_before: float = 0.0,
             until: Callable[[dict[str, Any]], bool] | None = None) -> dict[int, dict[str, Any]]:
        """The latest published state of every rank of `round_key` outside `local`.

        A rank is read again when what was read of it is older than `max_age_s`, within
        READ_BUDGET_S (the rest the next time), and only until a state read satisfies `until`
        (one rank that shows the job is not stuck answers the question of a thousand). Ranks read
        before `not_before` (time.time()) are left out; when the store cannot be reached, the
        others are as last read.
        """
        with self._lock:
            cached = self._cache.setdefault(round_key, {})
            present = self._present.setdefault(round_key, set())
            older_than = time.time() - max_age_s
            if not present >= set(range(world_size)) - local or _due(cached, present - local, older_than):
                with _quiet_c10d():
                    self._read(round_key, world_size, local, older_than, until)
            return {rank: seen.state for rank, seen in cached.items() if seen.when >= not_before and rank not in local}

    def _read(self, round_key: RoundKey, world_size: int, local: set[int], older_than: float,
              until: Callable[[dict[str, Any]], bool] | None) -> None:
        cached, present = self._cache[round_key], self._present[round_key]
        store = self._connected()
        if store is None:
            return
        deadline = time.monotonic() + READ_BUDGET_S
        try:
            if not present >= set(range(world_size)) - local and store.check([self._index_key(round_key)]):
                present.update(int(r) for r in store.get(self._index_key(round_key)).decode().split(",") if r)
            due = _due(cached, present - local, older_than)
            for start in range(0, len(due), READ_BATCH):
                if start and time.monotonic() > deadline:
                    return  # the monitor must not wait on the board
                batch = due[start : start + READ_BATCH]
                values = store.multi_get([self._key(round_key, rank) for rank in batch])
                now = time.time()
                settled = False
                for rank, data in zip(batch, values):
                    state = expand_state(data)
                    if state is not None:
                        cached[rank] = _Read(state, now)
                        settled = settled or (until is not None and until(state))
                if settled:
                    return
        except Exception:  # the store went away or did not answer in time
            self._disconnect()

    # -- the end of a round --

    def done(self, round_key: RoundKey, ranks: int) -> None:
        """Say that this node, with `ranks` ranks, has published its ranks' ends and read the others'."""
        with self._lock, _quiet_c10d():
            store = self._connected()
            if store is None:
                return
            try:
                store.add(self._done_key(round_key), ranks)
            except Exception:
                self._disconnect()

    def all_done(self, round_key: RoundKey, world_size: int) -> bool:
        """Whether the nodes of all `world_size` ranks said `done`; True when the store cannot be
        reached (there is nothing left to wait for)."""
        with self._lock, _quiet_c10d():
            store = self._connected()
            if store is None:
                return True
            try:
                return store.add(self._done_key(round_key), 0) >= world_size
            except Exception:
                self._disconnect()
                return True

    # -- `gradsync stacks`, job-wide --

    def request_stacks(self, request_id: str) -> bool:
        """Ask every node's ranks for their threads' stacks: each launcher relays the request to its
        ranks (`stacks_request`). False when the store cannot be reached."""
        with self._lock, _quiet_c10d():
            store = self._connected()
            if store is None:
                return False
            try:
                store.set(self._stacks_key(), request_id)
                return True
            except Exception:
                self._disconnect()
                return False

    def stacks_request(self) -> str | None:
        """The id of the latest `gradsync stacks` request of this job, None before any (or without the store)."""
        with self._lock, _quiet_c10d():
            store = self._connected()
            if store is None:
                return None
            try:
                return store.get(self._stacks_key()).decode() if store.check([self._stacks_key()]) else None
            except Exception:
                self._disconnect()
                return None

    @property
    def reachable(self) -> bool:
        """False while the store is known to be gone (until the next retry)."""
        return time.monotonic() >= self._retry_at

    # -- the connection --

    def _key(self, round_key: RoundKey, rank: int) -> str:
        return f"{self.prefix}/{round_key}/rank{rank}"

    def _index_key(self, round_key: RoundKey) -> str:
        """The ranks that published in `round_key`, appended as "R," on each rank's first publish:
        a reader asks for those keys only (a get of a missing key would wait for it)."""
        return f"{self.prefix}/{round_key}/ranks"

    def _stacks_key(self) -> str:
        return f"{self.prefix}/stacks-request"

    def _done_key(self, round_key: RoundKey) -> str:
        """How many ranks' nodes have published their ends and read the others' (see `done`)."""
        return f"{self.prefix}/{round_key}/done"

    def _connected(self) -> TCPStore | None:
        """The store client, connected on first use; None while the store cannot be reached.

        A plain TCP connect is tried first, every time: when the store is gone it fails at once
        and quietly, where TCPStore would retry for its whole timeout.
        """
        if time.monotonic() < self._retry_at:
            return None
        try:
            socket.create_connection((self.address.host, self.address.port), timeout=CONNECT_TIMEOUT_S).close()
        except OSError:
            self._disconnect()
            return None
        if self._store is None:
            self._store = self._new_client()
            if self._store is None:
                self._disconnect()
        return self._store

    def _new_client(self) -> TCPStore | None:
        """A TCPStore client, or None when it is not connected within HANDSHAKE_TIMEOUT_S.

        Made on a thread of its own: TCPStore's handshake waits for the server's answer without
        a timeout (torch 2.13), so a server that accepts and never answers (a stopped process,
        one shutting down) would hold the monitor forever; the thread is left waiting instead,
        and no second one is started while it does.
        """
        if self._connecting is not None and self._connecting.is_alive():
            return None
        made: list[TCPStore] = []

        def connect() -> None:
            try:
                # wait_for_workers=False: this client must not count as one of the agents the
                # store's server waits for at rendezvous.
                made.append(TCPStore(self.address.host, self.address.port, is_master=False,
                                     timeout=timedelta(seconds=OP_TIMEOUT_S), wait_for_workers=False))
            except Exception:  # refused, timed out: `made` stays empty
                pass

        self._connecting = threading.Thread(target=connect, name="gradsync-store-connect", daemon=True)
        self._connecting.start()
        self._connecting.join(HANDSHAKE_TIMEOUT_S)
        return made[0] if made else None

    def _disconnect(self) -> None:
        self._store = None
        self._retry_at = time.monotonic() + RETRY_AFTER_S


@functools.cache
def _c10_log_threshold() -> ctypes.c_int | None:
    """libc10's log threshold (FLAGS_caffe2_log_level), or None where this torch does not export it."""
    folder = os.path.join(os.path.dirname(torch.__file__), "lib")
    for name in ("libc10.so", "libc10.dylib"):
        try:
            return ctypes.c_int.in_dll(ctypes.CDLL(os.path.join(folder, name)), "FLAGS_caffe2_log_level")
        except (OSError, ValueError):
            continue
    return None


@contextlib.contextmanager
def _quiet_c10d() -> Iterator[None]:
    """Keep c10's C++ log quiet while the board talks to the store.

    A store that goes away mid-request (node 0's agent ending with its job: the usual end of a
    multi-node job) makes TCPStore log a warning with a C++ stack trace on the launcher's console,
    though the board expects and handles it. torch has no switch for that but this process-wide
    threshold, so a C++ warning of another thread in the same instant is lost with it.
    """
    threshold = _c10_log_threshold()
    if threshold is None:
        yield
        return
    saved = threshold.value
    threshold.value = 3  # FATAL only
    try:
        yield
    finally:
        threshold.value = saved


# -- one rank's compact state ---------------------------------------------------------------------


def compact_state(state: Mapping[str, Any], stopped: bool = False, limit: int = MAX_RANK_BYTES) -> bytes:
    """A rank's snapshot or exit record (with its "records", "collectives" and "flight"), trimmed
    and compressed to at most `limit` bytes; `stopped`: its launcher stopped it."""
    for trim in _TRIMS:
        data = _encode({**_trimmed(state, **trim), "stopped_by_gradsync": stopped})
        if len(data) <= limit:
            return data
    essentials = {key: _bounded(state.get(key), items=0, text=200) for key in _ESSENTIALS if key in state}
    if isinstance(state.get("exit"), Mapping):
        essentials["exit"] = {k: _bounded(v, items=0, text=200) for k, v in state["exit"].items() if k != "traceback"}
    return _encode({**essentials, "stopped_by_gradsync": stopped})


def expand_state(data: bytes) -> dict[str, Any] | None:
    """A published state as the analysis reads a rank's files (member lists restored), marked
    "remote"; None when it cannot be decoded or lacks what the monitor counts on."""
    try:
        state = json.loads(zlib.decompress(data))
    except (zlib.error, ValueError):
        return None
    if not isinstance(state, dict) or not all(isinstance(state.get(key), (int, float)) for key in _REQUIRED):
        return None
    for group in (state.get("groups") or {}).values():
        if isinstance(group, dict):
            group["ranks"] = _members(group.get("ranks"))
    flight = state.get("flight")
    if isinstance(flight, dict) and isinstance(flight.get("groups"), dict):
        flight["groups"] = {name: _members(ranks) for name, ranks in flight["groups"].items()}
    state["remote"] = True
    return state


def _encode(state: Mapping[str, Any]) -> bytes:
    return zlib.compress(json.dumps(state, separators=(",", ":"), default=str).encode(), 6)


def _trimmed(state: Mapping[str, Any], *, records: int, frames: int, checkpoints: int, flight: int, items: int,
             text: int) -> dict[str, Any]:
    """The state with its long parts cut to the newest `records`/`frames`/`checkpoints`/`flight`
    entries, other lists and mappings to `items`, texts to `text` characters."""
    out = {key: _bounded(value, items, text) for key, value in state.items()
           if key not in ("records", "stack", "groups", "flight", "exit")}
    kept_records = [_bounded(r, items, text) for r in (state.get("records") or [])[-records:]] if records else []
    if "records" in state:
        out["records"] = kept_records
    if "stack" in state:
        out["stack"] = [_bounded(f, items, text) for f in (state.get("stack") or [])[-frames:]]
    if isinstance(state.get("groups"), Mapping):
        out["groups"] = {
            name: {
                **{k: _bounded(v, items, text) for k, v in group.items() if k not in ("ranks", "checkpoints")},
                "ranks": _packed(group.get("ranks")),
                "checkpoints": list(group.get("checkpoints") or [])[-checkpoints:] if checkpoints else [],
            }
            for name, group in _relevant_groups(state["groups"], kept_records)
        }
    if isinstance(state.get("flight"), Mapping):
        whole = state["flight"]
        out["flight"] = {
            **{k: _bounded(v, items, text) for k, v in whole.items() if k not in ("entries", "groups")},
            "entries": [_bounded(e, items, text) for e in (whole.get("entries") or [])[-flight:]] if flight else [],
            "groups": {name: _packed(ranks) for name, ranks in list((whole.get("groups") or {}).items())[:_MAX_GROUPS]},
        }
    if isinstance(state.get("exit"), Mapping):
        outcome = dict(state["exit"])
        traceback = outcome.pop("traceback", None)
        out["exit"] = {k: _bounded(v, items, text) for k, v in outcome.items()}
        if traceback is not None:
            out["exit"]["traceback"] = str(traceback)[-text:]  # its end says where it was raised
    return out


def _relevant_groups(groups: Mapping[str, Any], records: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    """At most _MAX_GROUPS of the rank's groups: those of its newest records first."""
    used = {r.get("group") for r in records if isinstance(r, dict)}
    named = sorted(groups.items(), key=lambda item: (item[0] not in used, item[0]))
    return [(name, group) for name, group in named[:_MAX_GROUPS] if isinstance(group, Mapping)]


def _bounded(value: Any, items: int, text: int, depth: int = 0) -> Any:
    """`value` with strings cut to `text` characters and lists and mappings to their first `items`."""
    if isinstance(value, str):
        return value[:text]
    if depth > 6:
        return None
    if isinstance(value, Mapping):
        return {str(k)[:text]: _bounded(v, items, text, depth + 1) for k, v in list(value.items())[:items]}
    if isinstance(value, (list, tuple)):
        return [_bounded(v, items, text, depth + 1) for v in value[:items]]
    return value


def _packed(ranks: Any) -> Any:
    """A group's member list, short: an evenly spaced one (every group torchrun-style parallelism
    builds) as {"range": [start, stop, step]}; an irregular one beyond _MAX_MEMBERS left out."""
    if not isinstance(ranks, list) or len(ranks) <= 16 or not all(isinstance(r, int) for r in ranks):
        return ranks
    step = ranks[1] - ranks[0]
    if step > 0 and all(b - a == step for a, b in zip(ranks, ranks[1:])):
        return {"range": [ranks[0], ranks[-1] + step, step]}
    return ranks if len(ranks) <= _MAX_MEMBERS else None


def _members(packed: Any) -> Any:
    if isinstance(packed, dict) and isinstance(packed.get("range"), list) and len(packed["range"]) == 3:
        return list(range(*packed["range"]))
    return packed

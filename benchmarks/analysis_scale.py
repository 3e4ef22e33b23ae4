"""How long `gradsync run`'s diagnosis takes on a large job: synthetic records of N ranks.

The requirement is that 1,024 ranks' records are analysed within a few seconds. Nothing is
launched here. Each rank gets what the monitor would read from a run folder (`read_attempt`): a
snapshot, or an exit record, with a ~30-frame stack, its groups' CRC checkpoints, and a full ring
of 256 records. The job is a data-parallel training loop. DDP's buffer broadcast and gradient
reduction run on the default group. The user's metric all_reduces run on the default group, on a
node group of `--group-size` ranks, and on a cross-node group that joins the ranks with the same
local rank. A barrier closes every 8th step. With `--flight` each rank also leaves a Flight
Recorder dump of its last 512 operations (DDP's backward pass as 4 bucket all_reduces), as NCCL
jobs do. The rank files are turned into views with `build_views`, then `diagnose` is timed on
each failure below:

  hang       every rank waits in the same barrier
  stuck      one rank is blocked outside any collective while the others wait in the barrier
  extra      one rank called an extra all_reduce two collectives before the mismatch it caused
  crash      one rank raised in its data loading; the others got "Connection closed by peer"
  exited     one rank finished its script one step early; the others wait in the next step

The benchmark also checks the diagnosis. It exits with 1 if a scenario's error finding has
the wrong category or names the wrong ranks, or if one scenario's `build_views` and `diagnose`
together take longer than `--budget-s` of wall-clock time. The CPU seconds are printed beside
the wall-clock ones: on a busy machine the two differ. `--profile SCENARIO` prints where that
scenario's diagnosis spends its time.

Run with `make bench-analysis-scale` or
`python benchmarks/analysis_scale.py [--ranks 1024] [--flight] [--budget-s 5] [--profile hang]`.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import sys
import time
import zlib
from dataclasses import dataclass
from typing import Any

from gradsync.run.analysis.rules import diagnose
from gradsync.run.collectives import CHECKPOINT_EVERY, GroupSequence
from gradsync.run.flight import KEPT_ENTRIES
from gradsync.run.monitor import build_views
from gradsync.run.options import RunOptions
from gradsync.rundir.io import RING_SLOT_BYTES
from gradsync.rundir.records import RECORD_FIELDS

RING = RunOptions.__dataclass_fields__["ring_size"].default  # the ring's slots
CHECKPOINTS_KEPT = GroupSequence([]).checkpoints.maxlen
STEPS = 2000  # training steps before the failure: about 12,000 collectives per rank
BARRIER_EVERY = 8
CROSS_EVERY = 4
T0 = 1_750_000_000.0  # when the job started
STEP_S = 0.35
STALL_S = 300.0  # how long the ranks have waited when the stall is diagnosed


@dataclass(frozen=True)
class Call:
    """One collective of the training script; `group` is "default", "node" or "cross"."""

    group: str
    op: str
    signature: str
    kind: str
    site: str


GRADIENTS = "bfloat16[1342177280]+float32[2048]"  # a 1.3B-parameter model's gradients, per dtype
BUFFERS = Call("default", "broadcast", "12 buffers", "DDP buffer broadcast (train, grad)", "train.py:151")
BACKWARD = Call("default", "all_reduce", GRADIENTS, "DDP gradients of a backward pass", "train.py:154")
GRAD_NORM = Call("cross", "all_reduce", "float32[1] op=SUM", "", "train.py:158")
NODE_METRICS = Call("node", "all_reduce", "float32[4] op=SUM", "", "utils/metrics.py:41")
LOSS = Call("default", "all_reduce", "float32[1] op=SUM", "", "utils/metrics.py:57")
ACCURACY = Call("default", "all_reduce", "float32[1] op=SUM", "", "utils/metrics.py:58")
BARRIER = Call("default", "barrier", "", "", "train.py:171")
EXTRA = Call("default", "all_reduce", "float32[1] op=SUM", "", "train.py:164")  # `if rank == r: all_reduce(flag)`
BUCKETS = 4  # DDP's gradient buckets: one record per backward pass, one Flight Recorder entry per bucket


def backend_operations(call: Call) -> list[tuple[str, str]]:
    """(op, signature) of the operations a call makes the process group run, as Flight Recorder shows them."""
    if call is BACKWARD:
        return [("allreduce", "bfloat16[335544320]")] * BUCKETS
    if call is BUFFERS:
        return [("broadcast", "float32[4096], int64[1]")]
    return [("barrier" if call.op == "barrier" else call.op.replace("_", ""), call.signature.split(" op=")[0])]


def step_calls(step: int) -> list[Call]:
    calls = [BUFFERS, BACKWARD]
    if step % CROSS_EVERY == 0:
        calls.append(GRAD_NORM)
    calls += [NODE_METRICS, LOSS, ACCURACY]
    if step % BARRIER_EVERY == 0:
        calls.append(BARRIER)
    return calls


def program(steps: int, extra_in_last_step: bool = False) -> list[Call]:
    """The collectives a rank issued in `steps` steps, optionally with an extra all_reduce in the last."""
    calls = [call for step in range(1, steps + 1) for call in step_calls(step)]
    if extra_in_last_step:
        calls.insert(len(calls) - len(step_calls(steps)) + step_calls(steps).index(LOSS), EXTRA)
    return calls


@dataclass
class History:
    """What a rank's recorder holds after `calls`: its ring (as templates) and its groups' state."""

    # (index, seq, crc, call, backend operations so far on its group) of the newest collectives:
    # the last RING are the ring's; Flight Recorder's entries reach further back
    tail: list[tuple[int, int, int, Call, int]]
    groups: dict[str, dict[str, Any]]  # group kind -> {"seq", "crc", "checkpoints"}
    count: int


def history(calls: list[Call]) -> History:
    """Sequence numbers and running CRCs as `CollectiveRecorder.enter` computes them."""
    state = {kind: {"seq": 0, "crc": 0, "checkpoints": []} for kind in ("default", "node", "cross")}
    backend = dict.fromkeys(state, 0)
    tail = []
    first_kept = len(calls) - max(RING, KEPT_ENTRIES)
    for index, call in enumerate(calls):
        group = state[call.group]
        group["seq"] += 1
        group["crc"] = zlib.crc32(f"{call.op}|{call.signature}|{call.kind}".encode(), group["crc"])
        if group["seq"] % CHECKPOINT_EVERY == 0:
            group["checkpoints"].append([group["seq"], group["crc"]])
        backend[call.group] += len(backend_operations(call))
        if index >= first_kept:
            tail.append((index, group["seq"], group["crc"], call, backend[call.group]))
    for group in state.values():
        group["checkpoints"] = group["checkpoints"][-CHECKPOINTS_KEPT:]
    return History(tail, state, len(calls))


class Layout:
    """Which ranks share a node group and a cross-node group, and the groups' names (torch numbers
    its groups in creation order: the node groups first, then the cross-node ones)."""

    def __init__(self, ranks: int, group_size: int, flight: bool = False):
        self.ranks = ranks
        self.flight = flight  # whether each rank leaves a Flight Recorder dump (NCCL jobs do)
        self.size = min(group_size, ranks)
        self.nodes = -(-ranks // self.size)
        self.all = list(range(ranks))

    def name(self, kind: str, rank: int) -> str:
        if kind == "default":
            return "default"
        if kind == "node":
            return f"group {1 + rank // self.size}"
        return f"group {1 + self.nodes + rank % self.size}"

    def members(self, kind: str, rank: int) -> list[int]:
        if kind == "default":
            return self.all
        if kind == "node":
            start = rank - rank % self.size
            return list(range(start, min(start + self.size, self.ranks)))
        return list(range(rank % self.size, self.ranks, self.size))


# -- one rank's files, as read_attempt returns them ----------------------------------------------

PARAMETERS = [f"module.layers.{layer}.{part}" for layer in range(24) for part in (
    "attention.wqkv.weight", "attention.wo.weight", "attention_norm.weight", "feed_forward.w1.weight",
    "feed_forward.w2.weight", "feed_forward.w3.weight", "ffn_norm.weight",
)] + ["module.tok_embeddings.weight", "module.norm.weight", "module.output.weight"]

_TRAINING_STACK = [
    "<frozen runpy>:198 in _run_module_as_main",
    "<frozen runpy>:88 in _run_code",
    "gradsync/run/worker.py:331 in <module>",
    "gradsync/run/worker.py:290 in main",
    "gradsync/run/worker.py:230 in _run_target",
    "<frozen runpy>:291 in run_path",
    "<frozen runpy>:98 in _run_module_code",
    "<frozen runpy>:88 in _run_code",
    "train.py:212 in <module>",
    "train.py:198 in main",
    "train.py:176 in train",
]


def _stack(tail: list[str]) -> list[str]:
    return _TRAINING_STACK + tail


# Where the main thread of a rank sits, innermost last (about 30 frames, as stack_summary gives).
STACK_IN_BARRIER = _stack([
    "train.py:171 in train_epoch",
    "torch/distributed/c10d_logger.py:81 in wrapper",
    "gradsync/run/collectives.py:352 in wrapper",
    "gradsync/run/collectives.py:214 in run_blocking",
    "gradsync/run/collectives.py:353 in <lambda>",
    "torch/distributed/c10d_logger.py:81 in wrapper",
    "torch/distributed/distributed_c10d.py:4811 in barrier",
] + [f"torch/distributed/distributed_c10d.py:{4700 + i} in _wait" for i in range(12)])
STACK_IN_FORWARD = _stack([
    "train.py:151 in train_epoch",
    "torch/nn/modules/module.py:1773 in _wrapped_call_impl",
    "torch/nn/modules/module.py:1784 in _call_impl",
    "torch/nn/parallel/distributed.py:1657 in forward",
    "gradsync/run/collectives.py:570 in forward",
    "torch/nn/parallel/distributed.py:1551 in _pre_forward",
    "torch/nn/parallel/distributed.py:2030 in _sync_buffers",
    "torch/nn/parallel/distributed.py:2055 in _sync_module_buffers",
    "gradsync/run/collectives.py:592 in _sync_module_buffers",
    "gradsync/run/collectives.py:214 in run_blocking",
    "torch/nn/parallel/distributed.py:2075 in _default_broadcast_coalesced",
    "torch/distributed/utils.py:294 in _sync_params_and_buffers",
    "torch/distributed/distributed_c10d.py:2712 in _broadcast_coalesced",
] + [f"torch/utils/_contextlib.py:{116 + i} in decorate_context" for i in range(6)])
STACK_IN_ALL_REDUCE = _stack([
    "train.py:166 in train_epoch",
    "utils/metrics.py:58 in log_metrics",
    "torch/distributed/c10d_logger.py:81 in wrapper",
    "gradsync/run/collectives.py:352 in wrapper",
    "gradsync/run/collectives.py:214 in run_blocking",
    "gradsync/run/collectives.py:353 in <lambda>",
    "torch/distributed/c10d_logger.py:81 in wrapper",
    "torch/distributed/distributed_c10d.py:2806 in all_reduce",
] + [f"torch/distributed/distributed_c10d.py:{2700 + i} in _wait" for i in range(11)])
STACK_STUCK = _stack([
    "train.py:168 in train_epoch",
    "checkpointing.py:77 in save_shard",
    "checkpointing.py:52 in _acquire_lock",
    "filelock/_api.py:332 in acquire",
    "filelock/_api.py:376 in __enter__",
] + [f"site-packages/fsspec/implementations/local.py:{300 + i} in _open" for i in range(7)]
  + ["threading.py:327 in wait", "threading.py:629 in wait", "filelock/_unix.py:42 in _acquire", "selectors.py:415 in select",
     "socket.py:706 in readinto", "ssl.py:1315 in recv_into", "http/client.py:466 in read"])
STACK_FINISHED = _stack(["train.py:214 in <module>", "gradsync/run/worker.py:300 in main"])


def ring_records(hist: History, layout: Layout, rank: int, t_end: float, last_state: str) -> list[dict[str, Any]]:
    """The rank's ring as dicts (`read_ring`), oldest first; the last one in `last_state`."""
    records = []
    for index, seq, crc, call, _ in hist.tail[-RING:]:
        entered = _entered(hist, index, rank, t_end)
        records.append({
            "index": index, "group": layout.name(call.group, rank), "seq": seq, "op": call.op,
            "signature": call.signature, "kind": call.kind, "site": call.site, "state": "finished",
            "entered": entered, "finished": entered + 0.01, "crc": crc, "error": None,
        })
    last = records[-1]
    last["state"] = last_state
    if last_state != "finished":
        last["finished"] = None
    return records


def _entered(hist: History, index: int, rank: int, t_end: float) -> float:
    return t_end - (hist.count - index) * STEP_S / 6 + (rank * 7919 % 1000) * 1e-6


def flight_dump(hist: History, layout: Layout, rank: int, t_end: float, last_state: str, time_: float) -> dict[str, Any]:
    """The rank's compact Flight Recorder dump (records.FlightDump): its newest KEPT_ENTRIES operations."""
    entries = []
    for index, _, _, call, done in hist.tail:
        operations = backend_operations(call)
        entered = _entered(hist, index, rank, t_end)
        still_open = index == hist.count - 1 and last_state != "finished"
        for number, (op, signature) in enumerate(operations):
            entries.append({
                "group": layout.name(call.group, rank), "seq": done - len(operations) + 1 + number, "op": op,
                "signature": signature, "kind": "", "site": None, "state": "entered" if still_open else "finished",
                "entered": entered + 0.001 * (number + 1), "finished": None,
                "backend_state": "scheduled" if still_open else "completed", "source": "flight",
            })
    groups = {layout.name(kind, rank): layout.members(kind, rank) for kind in hist.groups}
    return {"time": time_, "entries": entries[-KEPT_ENTRIES:], "groups": groups}


def rank_files(
    hist: History, layout: Layout, rank: int, *, time_: float, last_state: str, stack: list[str], location: str,
    last_progress: float | None = None,
) -> dict[str, Any]:
    """One rank's snapshot with "records" and "collectives", as `read_attempt` returns it."""
    t_end = time_ if last_progress is None else last_progress
    records = ring_records(hist, layout, rank, t_end, last_state)
    groups = {
        layout.name(kind, rank): {
            "ranks": layout.members(kind, rank), "seq": state["seq"], "crc": state["crc"],
            "checkpoints": [list(c) for c in state["checkpoints"]],
        }
        for kind, state in hist.groups.items()
    }
    files = {
        "rank": rank, "local_rank": rank % layout.size, "world_size": layout.ranks, "local_world_size": layout.size,
        "attempt": 0, "host": f"node{rank // layout.size:04d}", "pid": 40000 + rank, "started": T0,
        "target": "train.py", "time": time_, "phase": "running",
        "last_progress": last_progress if last_progress is not None else records[-1]["entered"],
        "groups": groups, "stack": list(stack), "location": location,
        "backward_passes": STEPS, "first_nonfinite": None, "nonfinite_passes": 0, "unused_parameters": [],
        "ddp_parameters": [list(PARAMETERS)],
        "records": records, "collectives": hist.count,
    }
    if layout.flight:
        files["flight"] = flight_dump(hist, layout, rank, t_end, last_state, time_)
    return files


TRACEBACK = """Traceback (most recent call last):
  File "train.py", line 212, in <module>
    main()
  File "train.py", line 198, in main
    train(model, loader, optimizer)
  File "train.py", line 176, in train
    train_epoch(model, loader, optimizer, epoch)
  File "train.py", line 148, in train_epoch
    for batch in loader:
  File "torch/utils/data/dataloader.py", line 733, in __next__
    data = self._next_data()
  File "torch/utils/data/dataloader.py", line 1491, in _next_data
    return self._process_data(data, worker_id)
  File "data/dataset.py", line 88, in __getitem__
    raise ValueError(f"corrupt sample {index} in shard {shard} (truncated header)")
ValueError: corrupt sample 812341 in shard data/train-00017.tar (truncated header)
"""


class Failure:
    """What torchrun's agent reports for a failed worker (ProcessFailure's two fields used here)."""

    def __init__(self, exitcode: int):
        self.exitcode = exitcode

    def signal_name(self) -> str:
        return "SIGTERM" if self.exitcode == -15 else f"signal {-self.exitcode}"


# -- the scenarios ------------------------------------------------------------------------------


@dataclass
class Scenario:
    name: str
    expected: str
    trigger: str
    snapshots: dict[int, dict[str, Any]]
    exits: dict[int, dict[str, Any]]
    failures: dict[int, Failure]
    alive: list[int]
    now: float
    culprits: list[int]  # the ranks the error finding must name


def _odd_rank(ranks: int) -> int:
    return min(ranks - 1, ranks // 2 + 3)  # not rank 0, not the last: neither end of a loop


def scenario(name: str, ranks: int, group_size: int, flight: bool = False) -> Scenario:
    layout = Layout(ranks, group_size, flight)
    odd = _odd_rank(ranks)
    t_end = T0 + STEPS * STEP_S
    now = t_end + STALL_S
    healthy = history(program(STEPS))  # ends with the barrier of step STEPS (a multiple of 8)

    def waiting(rank: int, hist: History = healthy, stack: list[str] = STACK_IN_BARRIER, location: str = "train.py:171") -> dict:
        return rank_files(hist, layout, rank, time_=now - 0.4, last_state="entered", stack=stack, location=location,
                          last_progress=t_end)

    snapshots: dict[int, dict[str, Any]] = {}
    exits: dict[int, dict[str, Any]] = {}
    failures: dict[int, Failure] = {}
    if name == "hang":
        snapshots = {rank: waiting(rank) for rank in range(ranks)}
        return Scenario(name, "hang", "stall", snapshots, exits, failures, list(range(ranks)), now, list(range(ranks)))
    if name == "stuck":
        before_barrier = history(program(STEPS)[:-1])
        for rank in range(ranks):
            if rank == odd:
                snapshots[rank] = rank_files(before_barrier, layout, rank, time_=now - 0.4, last_state="finished",
                                             stack=STACK_STUCK, location="checkpointing.py:52", last_progress=t_end - 0.2)
            else:
                snapshots[rank] = waiting(rank)
        return Scenario(name, "rank_stuck", "stall", snapshots, exits, failures, list(range(ranks)), now, [odd])
    if name == "extra":
        extra = history(program(STEPS, extra_in_last_step=True)[:-1])  # blocked in ACCURACY, facing the barrier
        for rank in range(ranks):
            if rank == odd:
                snapshots[rank] = waiting(rank, extra, STACK_IN_ALL_REDUCE, "utils/metrics.py:58")
            else:
                snapshots[rank] = waiting(rank)
        return Scenario(name, "collective_mismatch", "stall", snapshots, exits, failures, list(range(ranks)), now, [odd])
    if name == "crash":
        # Rank `odd` raised while loading the batch of step STEPS + 1: the others were in that
        # step's buffer broadcast, which then failed on them.
        next_step = history(program(STEPS + 1)[:1 - len(step_calls(STEPS + 1))])  # ends with BUFFERS
        t_fail = t_end + 2.0
        for rank in range(ranks):
            if rank == odd:
                data = rank_files(healthy, layout, rank, time_=t_fail, last_state="finished",
                                  stack=STACK_FINISHED, location="data/dataset.py:88")
                data["exit"] = {
                    "status": "exception", "time": t_fail, "type": "ValueError",
                    "message": "corrupt sample 812341 in shard data/train-00017.tar (truncated header)",
                    "location": "data/dataset.py:88", "collective": None,
                    "traceback": TRACEBACK,
                }
            else:
                data = rank_files(next_step, layout, rank, time_=t_fail + 0.5, last_state="failed",
                                  stack=STACK_FINISHED, location="train.py:151", last_progress=t_fail + 0.05)
                last = data["records"][-1]
                message = f"[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.{odd // 250}.{odd % 250}]:29500"
                last["finished"] = t_fail + 0.05
                last["error"] = f"RuntimeError: {message}"[:100]
                data["exit"] = {
                    "status": "exception", "time": t_fail + 0.06 + rank * 1e-5, "type": "RuntimeError", "message": message,
                    "location": "train.py:151", "traceback": f"Traceback (most recent call last):\n  ...\nRuntimeError: {message}\n",
                    "collective": {"group": "default", "seq": last["seq"], "op": last["op"], "site": last["site"]},
                }
            exits[rank] = data
            snapshots[rank] = {key: value for key, value in data.items() if key != "exit"}
            failures[rank] = Failure(1)
        return Scenario(name, "rank_crashed", "failure", snapshots, exits, failures, [], t_fail + 1.0, [odd])
    if name == "exited":
        # Rank `odd` had one batch fewer: it left after step STEPS; the others wait in the next one.
        next_step = history(program(STEPS + 1)[:1 - len(step_calls(STEPS + 1))])
        for rank in range(ranks):
            if rank == odd:
                data = rank_files(healthy, layout, rank, time_=t_end + 0.1, last_state="finished",
                                  stack=STACK_FINISHED, location="train.py:214")
                data["exit"] = {"status": "finished", "time": t_end + 0.1}
                exits[rank] = data
                snapshots[rank] = {key: value for key, value in data.items() if key != "exit"}
            else:
                snapshots[rank] = waiting(rank, next_step, STACK_IN_FORWARD, "train.py:151")
        alive = [rank for rank in range(ranks) if rank != odd]
        return Scenario(name, "rank_exited", "stall", snapshots, exits, failures, alive, now, [odd])
    raise ValueError(name)


SCENARIOS = ("hang", "stuck", "extra", "crash", "exited")


def views_of(s: Scenario) -> dict:
    """As the monitor does: build_views, then mark the ranks still running."""
    views = build_views(s.snapshots, s.exits, s.failures, set(), {})
    for rank in s.alive:
        views[rank].alive = True
    return views


def run_diagnosis(s: Scenario, views: dict) -> dict[str, Any]:
    return diagnose(views, trigger=s.trigger, now=s.now, world_size=len(views))


def _ranks(ranks: list[int]) -> str:
    return f"{len(ranks)} ranks" if len(ranks) > 3 else ", ".join(map(str, ranks)) or "none"


def timed(function, *args) -> tuple[Any, float, float]:
    """`function(*args)`, its wall-clock seconds and this process's CPU seconds (the two part on a busy machine)."""
    gc.collect()
    start, start_cpu = time.perf_counter(), time.process_time()
    result = function(*args)
    return result, time.perf_counter() - start, time.process_time() - start_cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--group-size", type=int, default=8, help="ranks per node group (a node's GPUs)")
    parser.add_argument("--flight", action="store_true",
                        help=f"give each rank a Flight Recorder dump of its last {KEPT_ENTRIES} operations, as NCCL jobs leave")
    parser.add_argument("--budget-s", type=float, default=5.0, help="the most one scenario's build_views and diagnose may take (wall clock)")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated, of {', '.join(SCENARIOS)}")
    parser.add_argument("--profile", metavar="SCENARIO", help="print cProfile's top functions for that scenario's diagnose()")
    parser.add_argument("--profile-lines", type=int, default=25)
    args = parser.parse_args()
    if args.ranks < 2:
        parser.error("--ranks must be at least 2")
    names = [name.strip() for name in args.scenarios.split(",") if name.strip()]
    unknown = sorted(set(names) - set(SCENARIOS))
    if unknown:
        parser.error(f"unknown scenario(s): {', '.join(unknown)}")
    if args.profile and args.profile not in names:
        parser.error(f"--profile {args.profile}: not among the scenarios run ({', '.join(names)})")

    # What each rank publishes (to inform what a node would send): its snapshot file, rewritten
    # every second, and its ring file of fixed slots, each holding one record as a JSON array.
    sample = scenario("hang", args.ranks, args.group_size, args.flight).snapshots[0]
    published = {key: value for key, value in sample.items() if key not in ("records", "collectives", "flight")}
    used = sum(len(json.dumps([record[name] for name in RECORD_FIELDS])) for record in sample["records"])
    print(f"one rank's files at {args.ranks} ranks: snapshot {len(json.dumps(published)) / 1024:.1f} KiB of JSON "
          f"({len(json.dumps(published['groups'])) / 1024:.1f} KiB of it its groups' members and checkpoints), "
          f"ring {RING * RING_SLOT_BYTES / 1024:.0f} KiB ({RING} slots of {RING_SLOT_BYTES} B, {used / 1024:.1f} KiB used)"
          + (f", Flight Recorder dump {len(json.dumps(sample['flight'])) / 1024:.1f} KiB" if args.flight else ""))
    del sample, published

    print(f"{'scenario':<10} {'ranks':>6} {'build_views s':>14} {'diagnose s':>11} {'(CPU s)':>8}  category (expected; checked)")
    failed = []
    for name in names:
        s = scenario(name, args.ranks, args.group_size, args.flight)
        views, build_s, _ = timed(views_of, s)
        diagnosis, diagnose_s, diagnose_cpu_s = timed(run_diagnosis, s, views)
        errors = [f for f in diagnosis["findings"] if f["severity"] == "error"]
        category = errors[0]["category"] if errors else "(none)"
        named = errors[0]["ranks"] if errors else []
        verdict = ""
        if category != s.expected or named != s.culprits:
            verdict = f"  WRONG: expected {s.expected} naming {_ranks(s.culprits)}, got ranks {_ranks(named)}"
            failed.append(f"{name}: diagnosed {category} naming {_ranks(named)}, expected {s.expected} naming {_ranks(s.culprits)}")
        if build_s + diagnose_s > args.budget_s:
            verdict += f"  OVER BUDGET ({args.budget_s:g} s)"
            failed.append(f"{name}: the analysis took {build_s + diagnose_s:.2f} s, more than {args.budget_s:g} s")
        print(f"{name:<10} {args.ranks:>6} {build_s:>14.3f} {diagnose_s:>11.3f} {diagnose_cpu_s:>8.3f}  {category}{verdict}", flush=True)
        if name == args.profile:
            profiler = cProfile.Profile()
            profiler.runcall(run_diagnosis, s, views_of(s))  # fresh views: nothing cached from the timed run
            pstats.Stats(profiler, stream=sys.stdout).sort_stats("cumulative").print_stats(args.profile_lines)
        del s, views, diagnosis
    for line in failed:
        print(f"FAILED {line}", file=sys.stderr)
    if not failed:
        print(f"every scenario diagnosed as expected, each analysed within {args.budget_s:g} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""The collective recorder on real Gloo process groups: what it records, where, and what it costs."""

import functools
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gradsync.run.analysis.wording import describe
from gradsync.run.collectives import CollectiveRecorder, Record, WaitClock, install
from gradsync.rundir.records import RECORD_FIELDS
from tests.harness import launch
from tests.run.side_by_side import gloo_world, gradsync_warnings, outcome


def _recorded(fn, record_buckets=False):
    """Install a recorder, join a 2-rank group, run fn(rank), return the records as dicts."""
    recorder = CollectiveRecorder(ring_size=64)
    uninstall = install(recorder, record_buckets=record_buckets)
    try:
        dist.init_process_group("gloo")
        fn(dist.get_rank(), recorder)
        dist.barrier()
        dist.destroy_process_group()
    finally:
        uninstall()
    return {
        "records": recorder.recent(64),
        "groups": recorder.group_states(),
        "first_nonfinite": recorder.first_nonfinite,
        "unused": recorder.unused_parameters(),
        "passes": recorder.backward_passes,
        "phase": recorder.phase,
    }


def _public_collectives(rank, recorder):
    t = torch.ones(3)
    dist.all_reduce(t)  # line: all_reduce
    dist.broadcast(t, src=1)
    out = [torch.zeros(3) for _ in range(2)]
    dist.all_gather(out, t)
    dist.all_reduce(torch.ones(2, dtype=torch.float64), op=dist.ReduceOp.MAX)
    objects = [None, None]
    dist.all_gather_object(objects, {"rank": rank})
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    if rank == 0:
        dist.send(torch.ones(1), dst=1)
    else:
        dist.recv(torch.zeros(1), src=0)
    sub = dist.new_group([0, 1])  # line: new_group
    dist.all_reduce(t, group=sub)
    # The tensor all-gather under its current name (torch 2.13 renamed it, deprecating the old).
    gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather_tensor(torch.zeros(4), torch.ones(2))


def record_public_collectives():
    return _recorded(_public_collectives)


@pytest.mark.launches
def test_records_public_collectives_with_user_sites_and_agreed_signatures():
    results = launch(record_public_collectives, 2)
    line = next(i for i, text in enumerate(open(__file__), 1) if "# line: all_reduce" in text)
    for rank, result in enumerate(results):
        records = result["records"]
        default = [r for r in records if r["group"] == "default" and r["seq"] is not None]
        ops = [r["op"] for r in default]
        assert ops[:5] == ["all_reduce", "broadcast", "all_gather", "all_reduce", "all_gather_object"], ops
        assert default[-2]["op"] in ("all_gather_single", "all_gather_into_tensor"), ops  # then the barrier
        assert default[-2]["signature"] == "float32[2]"
        assert default[0]["site"].endswith(f"tests/run/test_collectives.py:{line}")
        assert default[0]["signature"] == "float32[3] op=SUM"
        assert default[1]["signature"] == "float32[3] src=1"
        assert default[3]["signature"] == "float64[2] op=MAX"
        assert [r["seq"] for r in default] == list(range(1, len(default) + 1))
        assert all(r["state"] == "finished" for r in records), [(r["op"], r["seq"], r["state"]) for r in records]
        p2p = [r for r in records if r["op"] in ("send", "recv")]
        assert len(p2p) == 1 and p2p[0]["seq"] is None, "point-to-point stays out of the compared sequence"
        (created,) = [r for r in records if r["group"] == "group creations"]
        assert (created["op"], created["signature"], created["seq"]) == ("new_group", "ranks=[0, 1]", 1), created
        created_at = next(i for i, text in enumerate(open(__file__), 1) if "# line: new_group" in text)
        assert created["site"].endswith(f"tests/run/test_collectives.py:{created_at}") and created["state"] == "finished"
        sub = [r for r in records if r["group"] not in ("default", "group creations")]
        assert sub and sub[-1]["op"] == "all_reduce" and sub[-1]["seq"] == 1
        assert result["phase"] == "teardown"
    # The compared sequences agree exactly across ranks; point-to-point differs but is excluded.
    assert results[0]["groups"]["default"]["crc"] == results[1]["groups"]["default"]["crc"]
    assert results[0]["groups"]["default"]["ranks"] == [0, 1]


def test_issued_collectives_are_finished_by_polling_once_their_futures_complete():
    recorder = CollectiveRecorder()
    done, failing, pending = (torch.futures.Future() for _ in range(3))
    records = [recorder.enter("irecv", None, "", site="x.py:1") for _ in range(3)]
    for record, future in zip(records, (done, failing, pending)):
        recorder.finish_when_done(record, future)
    done.set_result(None)
    failing.set_exception(RuntimeError("Connection closed by peer"))
    recorder.enter("barrier", None, "", site="x.py:2")  # the next record settles what completed
    assert [r.state for r in records] == ["finished", "failed", "issued"]
    assert "Connection closed by peer" in records[1].error
    pending.set_result(None)
    recorder.settle()
    assert records[2].state == "finished" and not recorder.issued



def test_a_collective_the_script_makes_from_its_own_thread_says_which_thread():
    recorder = CollectiveRecorder()
    made: list = []
    worker = threading.Thread(target=lambda: made.append(recorder.enter("all_reduce", None, "float32[1] op=SUM", site="x.py:9")),
                              name="heartbeat")
    worker.start()
    worker.join()
    on_main = recorder.enter("all_reduce", None, "float32[1] op=SUM", site="x.py:9")
    ddp_on_a_device_thread: list = []
    worker = threading.Thread(target=lambda: ddp_on_a_device_thread.append(
        recorder.enter("all_reduce", None, "float32[9]", kind="DDP gradient bucket 0", site="x.py:24")))
    worker.start()
    worker.join()
    assert made[0].args == {"thread": "heartbeat"} and on_main.args is None
    assert ddp_on_a_device_thread[0].args is None  # DDP's own buckets say what issued them already
    # Said, never compared: the thread is in neither the signature nor the kind.
    assert (made[0].signature, made[0].kind) == (on_main.signature, on_main.kind)
    assert "from thread 'heartbeat'" in describe({name: getattr(made[0], name) for name in RECORD_FIELDS})


def test_collectives_entered_by_two_threads_at_once_get_numbers_and_ring_slots_of_their_own():
    recorder = CollectiveRecorder(ring_size=4096)
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can: the race shows
    try:
        def enter_many(site):
            for _ in range(1000):
                recorder.enter("all_reduce", None, "float32[1] op=SUM", site=site)

        workers = [threading.Thread(target=enter_many, args=(f"x.py:{line}",)) for line in (9, 24)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    finally:
        sys.setswitchinterval(previous)
    records = list(recorder.ring)
    assert sorted(r.index for r in records) == list(range(2000))
    assert sorted(r.seq for r in records) == list(range(1, 2001))

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(4, 8)
        self.norm = torch.nn.BatchNorm1d(8)
        self.head = torch.nn.Linear(8, 1)
        self.unused_head = torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.norm(self.body(x)))


def _ddp_training(rank, recorder, nan_rank=None, find_unused=False, hook=None):
    torch.manual_seed(0)
    model = DistributedDataParallel(Net(), find_unused_parameters=find_unused)
    if hook == "python":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        model.register_comm_hook(None, allreduce_hook)
    elif hook == "builtin":
        model._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1, 5):
        x = torch.randn(4, 4)
        if rank == nan_rank and step == 3:
            x = x * float("nan")
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()  # line: backward
        optimizer.step()
    model.eval()
    with torch.no_grad():
        model(torch.randn(2, 4))
    model.train()
    with model.no_sync():  # an accumulation micro-step: no reduction, nothing recorded
        model(torch.randn(4, 4)).pow(2).mean().backward()


def record_ddp(nan_rank=None, find_unused=True, hook=None, record_buckets=False):
    return _recorded(lambda rank, rec: _ddp_training(rank, rec, nan_rank, find_unused, hook), record_buckets)


def _assert_ddp_records(results, gradient_kind):
    line = next(i for i, text in enumerate(open(__file__), 1) if "# line: backward" in text)
    for result in results:
        kinds = [r["kind"] for r in result["records"]]
        assert kinds[0].startswith("DDP construction")
        reductions = [r for r in result["records"] if r["kind"].startswith("DDP gradient")]
        assert {r["kind"] for r in reductions} == {gradient_kind}, kinds
        assert len(reductions) == 4 and all(r["site"].endswith(f"tests/run/test_collectives.py:{line}") for r in reductions)
        assert all(r["state"] == "finished" for r in reductions)
        broadcasts = [r["kind"] for r in result["records"] if r["kind"].startswith("DDP buffer")]
        assert broadcasts[:4] == ["DDP buffer broadcast (train, grad)"] * 4
        # The eval forward after training still broadcasts (DDP syncs before the forward after a
        # training one) and says that it happened in eval mode without grad.
        assert broadcasts[-1] == "DDP buffer broadcast (eval, no_grad)"
        assert result["passes"] == 4
        assert result["unused"] == ["unused_head.weight", "unused_head.bias"]
    # The NaN started on rank 1 at pass 3; rank 0 only sees it one pass later, after averaging.
    assert results[1]["first_nonfinite"]["step"] == 3
    assert results[0]["first_nonfinite"]["step"] == 4


@pytest.mark.launches
@pytest.mark.parametrize("hook", [None, "builtin"], ids=["default", "builtin_hook"])
def test_ddp_keeps_its_cpp_reduction_recorded_per_backward_pass(hook):
    results = launch(record_ddp, 2, nan_rank=1, find_unused=True, hook=hook)
    _assert_ddp_records(results, "DDP gradients of a backward pass")
    assert results[1]["first_nonfinite"]["source"] == "loss"
    # The signature compared across ranks: every gradient DDP reduces, unused ones included.
    signatures = {r["signature"] for r in results[0]["records"] if r["kind"].startswith("DDP gradient")}
    assert signatures == {f"float32[{sum(p.numel() for p in Net().parameters())}]"}


@pytest.mark.launches
@pytest.mark.parametrize("hook", [None, "python"], ids=["record_buckets", "user_hook"])
def test_buckets_are_recorded_and_gradients_checked_through_a_comm_hook(hook):
    results = launch(record_ddp, 2, nan_rank=1, find_unused=True, hook=hook, record_buckets=hook is None)
    _assert_ddp_records(results, "DDP gradient bucket 0")
    assert results[1]["first_nonfinite"]["source"] == "gradients"
    assert set(results[1]["first_nonfinite"]["parameters"]) >= {"body.weight", "head.weight"}


@pytest.mark.launches
def test_recorded_training_matches_plain_ddp_bitwise():
    plain = launch(train_and_return_parameters, 2, recorded=False)
    assert launch(train_and_return_parameters, 2, recorded=True) == plain
    # gradsync's replacement of DDP's default reduction by a Python hook must not change a bit
    assert launch(train_and_return_parameters, 2, recorded=True, record_buckets=True) == plain


def train_and_return_parameters(recorded, record_buckets=False):
    recorder = CollectiveRecorder()
    uninstall = install(recorder, record_buckets=record_buckets) if recorded else (lambda: None)
    try:
        dist.init_process_group("gloo")
        torch.manual_seed(1)
        model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3)))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        generator = torch.Generator().manual_seed(dist.get_rank())
        for _ in range(5):
            loss = model(torch.randn(8, 6, generator=generator)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        # No destroy_process_group(): with the DDP model still alive it would hold the group's last
        # reference and deadlock in its destructor (see tests/comm/test_compression.py).
    finally:
        uninstall()
    assert recorder.backward_passes == (5 if recorded else 0)
    return [p.detach().flatten().tolist() for p in model.parameters()]


def test_uninstall_restores_torch():
    def current():
        return (dist.all_reduce, DistributedDataParallel.forward, DistributedDataParallel.__init__, torch.autograd.backward)

    originals = current()
    uninstall = install(CollectiveRecorder())
    assert all(now is not before for now, before in zip(current(), originals))
    uninstall()
    assert current() == originals


def test_recording_costs_microseconds():
    """Guards the hot path against accidental slowness (generous bound; the benchmark measures the ratio)."""
    recorder = CollectiveRecorder()
    # This thread's CPU time, which other processes on the machine do not inflate as they do the
    # wall clock: ~15 µs per call measured on a loaded 2-core machine, the bound over 10x that.
    start = time.thread_time()
    for _ in range(2000):
        record = recorder.enter("all_reduce", None, "float32[4] op=SUM")
        recorder.finish(record)
    per_call = (time.thread_time() - start) / 2000
    assert per_call < 200e-6, f"{per_call * 1e6:.1f} µs of CPU per recorded collective"
    assert recorder.count == 2000 and len(recorder.ring) == recorder.ring.maxlen


class _CompiledAllReduce(torch.nn.Module):
    def forward(self, x):
        y = x * 2
        dist.all_reduce(y)
        return y + 1


def _compiled_collectives(rank, recorder):
    from torch._dynamo.utils import counters

    counters.clear()
    results = {}
    for fullgraph in (True, False):
        torch._dynamo.reset()
        compiled = torch.compile(_CompiledAllReduce(), fullgraph=fullgraph, backend="aot_eager")
        results[f"fullgraph={fullgraph}"] = compiled(torch.full((4,), float(rank + 1))).tolist()
    recorder.compiled = {"results": results, "graph_breaks": sum(counters["graph_break"].values())}


def record_compiled_collectives():
    captured = {}

    def run(rank, recorder):
        _compiled_collectives(rank, recorder)
        captured.update(recorder.compiled)

    return {**_recorded(run), **captured}


@pytest.mark.launches
def test_compiled_collectives_are_traced_by_dynamo_not_into_the_recorder():
    for result in launch(record_compiled_collectives, 2):
        assert result["results"] == {"fullgraph=True": [7.0] * 4, "fullgraph=False": [7.0] * 4}, "fullgraph compiles the all_reduce"
        assert result["graph_breaks"] == 0, "the recorder must not break the graph"


def test_settling_on_the_snapshot_thread_loses_no_collective_the_training_thread_issues():
    import threading

    from gradsync.run.collectives import Record

    recorder = CollectiveRecorder(ring_size=64)
    records = []
    stop = threading.Event()

    def snapshot_thread():
        while not stop.is_set():
            recorder.settle()

    settler = threading.Thread(target=snapshot_thread)
    settler.start()
    for index in range(20000):
        future = torch.futures.Future()
        record = Record(index, "default", index, "all_reduce", "float32[1]", "", None)
        records.append(record)
        recorder.finish_when_done(record, future)
        future.set_result(None)
    stop.set()
    settler.join()
    recorder.settle()
    assert [r.index for r in records if r.state != "finished"] == []


def _batched_exchange(rank, recorder):
    # A ring exchange through batch_isend_irecv: Gloo's send/recv works give no future.
    peer = 1 - rank
    ops = [dist.P2POp(dist.isend, torch.ones(2), peer), dist.P2POp(dist.irecv, torch.zeros(2), peer)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    recorder.settle()


def record_batched_exchange():
    return _recorded(_batched_exchange)


@pytest.mark.launches
def test_point_to_point_works_without_a_future_are_finished_once_completed():
    for result in launch(record_batched_exchange, 2):
        p2p = [r for r in result["records"] if r["op"] in ("isend", "irecv")]
        assert [r["op"] for r in p2p] == ["isend", "irecv"]
        assert [r["state"] for r in p2p] == ["finished", "finished"], "a completed isend must not look waited in"


PEER_DELAY_S = 0.2
# Rank 0 creates it (in the launch's folder, which every rank works in) just before it calls
# the collective of step N; rank 1 starts its delay only once it is there.
READY = "rank0-ready-{}"


def _rank0_ready(step):
    open(READY.format(step), "w").close()


def _after_rank0_is_ready(step):
    """Rank 1's delay, begun once rank 0 is about to wait for it: however slowly either rank
    runs, rank 0 then waits at least PEER_DELAY_S in that collective."""
    while not os.path.exists(READY.format(step)):
        time.sleep(0.005)
    time.sleep(PEER_DELAY_S)


def _late_peer_training(rank, recorder):
    """Rank 1 comes late to rank 0's collectives: the gradient reduction at the end of the first
    and third backward passes (DDP's reducer), a final metric all_reduce, and the bucket-rebuilding
    broadcast inside the second forward, which no hook sees. Rank 0 times each backward and the
    all_reduce from the outside, the bounds of what it can have waited in them."""
    model = DistributedDataParallel(torch.nn.Linear(4, 4))
    recorder.waits = WaitClock()  # DDP's construction broadcast waited too: not part of this
    timed_calls_s = 0.0
    for step in (1, 2, 3):
        if rank == 1 and step == 2:
            time.sleep(PEER_DELAY_S)  # rank 0 waits inside its forward's C++ broadcast
        loss = model(torch.randn(4, 4)).pow(2).mean()
        if rank == 0 and step != 2:
            _rank0_ready(step)
        if rank == 1 and step != 2:
            _after_rank0_is_ready(step)
        started = time.time()
        loss.backward()
        timed_calls_s += time.time() - started
    if rank == 0:
        _rank0_ready("all_reduce")
    else:
        _after_rank0_is_ready("all_reduce")
    started = time.time()
    dist.all_reduce(torch.ones(1))
    timed_calls_s += time.time() - started
    return timed_calls_s


def record_waits(record_buckets):
    recorder_waits = {}

    def train(rank, recorder):
        recorder_waits["timed_calls_s"] = _late_peer_training(rank, recorder)
        recorder_waits["s"] = recorder.communication_wait_s

    _recorded(train, record_buckets)
    return recorder_waits


@pytest.mark.launches
@pytest.mark.parametrize("record_buckets", [False, True], ids=["cpp_reduction", "bucket_hook"])
def test_a_rank_waiting_for_its_peer_counts_the_wait_at_the_end_of_backward_and_in_collectives(record_buckets):
    rank0, rank1 = launch(record_waits, 2, record_buckets=record_buckets)
    # Rank 0 waited PEER_DELAY_S at least in each of the three collectives rank 1 was late to
    # (less only by what rank 0 itself did between saying it was ready and starting to wait,
    # ~1 ms of gradient computation: 40 ms of slack each), and it counted no more than it spent
    # inside those calls: not the wait inside the second forward, nor any wait twice.
    assert 0.8 * 3 * PEER_DELAY_S <= rank0["s"] <= rank0["timed_calls_s"], rank0
    # Rank 1 came last or alongside rank 0 (step 2's backward) each time: it hardly waited (a few
    # ms of Gloo's round trips, 22 ms at most on a loaded 2-core machine; the bound is 4.5x that,
    # 10x and more the quiet figure).
    assert rank1["s"] < 0.5 * PEER_DELAY_S, rank1


# -- do no harm: the recorder's failures cost records, never the script's calls ---------------------
#
# Each scenario runs twice in this process on a world-size-1 Gloo group, once as a plain script and
# once under the recorder, whose bookkeeping is made to fail for real: a group the script destroyed,
# a ring file that is gone, an argument the recorder cannot read. What the script sees must be the
# same both times: the result, or the exception's type, message and innermost frame.


def _with_and_without_recorder(scenario: Callable[[], Any], folder: Path, recorder: CollectiveRecorder,
                               record_buckets: bool = False) -> tuple[tuple, tuple]:
    with gloo_world(folder / "plain"):
        plain = outcome(scenario)
    uninstall = install(recorder, record_buckets=record_buckets)
    try:
        with gloo_world(folder / "recorded"):
            recorded = outcome(scenario)
    finally:
        uninstall()
    return plain, recorded


def _failed_hooks(err: str) -> dict[str, str]:
    """The recorder's hooks that said they failed, once each, in rank 0's stderr -> their failure."""
    failed = {}
    for line in gradsync_warnings(err):
        hook, failure = re.search(r"warning: the collective recorder's (.+?) failed \((.+?), at \w+\.py:\d+\)", line).groups()
        assert hook not in failed, f"the {hook} said so twice"
        failed[hook] = failure
    return failed


def _without_ring_file(tmp_path: Path) -> CollectiveRecorder:
    """A recorder whose ring file can no longer be written (its mapping closed, as a vanished disk
    would leave it): every record fails to enter."""
    from gradsync.rundir import RingWriter

    recorder = CollectiveRecorder()
    recorder.sink = RingWriter(tmp_path / "ring", 16)
    recorder.sink.memory.close()
    return recorder


def _backward_after_destroying_the_group():
    # The user's case: a helper destroys the default group, the script later backpropagates
    # through its DDP model, whose group the recorder can no longer ask for its ranks.
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(3, 2))
    loss = model(torch.ones(4, 3)).pow(2).mean()
    dist.destroy_process_group()
    loss.backward()
    second = model(torch.ones(4, 3)).pow(2).mean()
    second.backward()
    return [p.grad.tolist() for p in model.parameters()]


def test_backward_after_the_script_destroyed_its_group_runs_as_without_gradsync(tmp_path, capsys):
    recorder = CollectiveRecorder()
    plain, recorded = _with_and_without_recorder(_backward_after_destroying_the_group, tmp_path, recorder)
    assert recorded == plain and plain[0] == "returned", (plain, recorded)
    failed = _failed_hooks(capsys.readouterr().err)
    assert list(failed) == ["backward hook"] and failed["backward hook"].startswith("KeyError"), failed
    assert [r.state for r in recorder.ring if r.state == "entered"] == [], "no record left waiting for good"
    assert recorder.backward_passes == 2, "the unrecorded passes still count: steps keep their numbers"


def _collective_on_a_destroyed_group(async_op: bool):
    group = dist.new_group([0])
    dist.destroy_process_group()
    tensor = torch.ones(3)
    work = dist.all_reduce(tensor, group=group, async_op=async_op)
    if work is not None:
        work.wait()
    return tensor.tolist(), work is None


@pytest.mark.parametrize("async_op", [False, True], ids=["blocking", "async"])
def test_a_collective_whose_group_was_destroyed_runs_as_without_gradsync(tmp_path, capsys, async_op):
    recorder = CollectiveRecorder()
    plain, recorded = _with_and_without_recorder(lambda: _collective_on_a_destroyed_group(async_op), tmp_path, recorder)
    assert recorded == plain and plain[0] == "returned", (plain, recorded)
    failed = _failed_hooks(capsys.readouterr().err)
    assert list(failed) == ["torch.distributed wrappers"] and failed["torch.distributed wrappers"].startswith("KeyError"), failed


def _training_with_buffers_and_collectives():
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        loss = model(torch.randn(8, 3)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    total = torch.ones(2)
    dist.all_reduce(total)
    work = dist.broadcast(total, src=0, async_op=True)
    work.wait()
    return [p.tolist() for p in model.parameters()], [b.tolist() for b in model.buffers()], total.tolist()


@pytest.mark.parametrize("record_buckets", [False, True], ids=["cpp_reduction", "bucket_hook"])
def test_a_ring_file_that_cannot_be_written_costs_the_records_not_the_training(tmp_path, capsys, record_buckets):
    recorder = _without_ring_file(tmp_path)
    plain, recorded = _with_and_without_recorder(_training_with_buffers_and_collectives, tmp_path, recorder, record_buckets)
    assert recorded == plain and plain[0] == "returned", (plain, recorded)
    hooks = {"DDP construction hook", "DDP buffer broadcast hook", "torch.distributed wrappers",
             "DDP gradient bucket hook" if record_buckets else "backward hook"}
    assert _failed_hooks(capsys.readouterr().err) == dict.fromkeys(hooks, "ValueError: mmap closed or invalid")
    # All or nothing: no record half-entered, no sequence advanced past what the peers would see.
    assert list(recorder.ring) == [] and all(s.seq == 0 for s in recorder.groups.values())
    assert recorder.backward_passes == 3, "the unrecorded passes still count: steps keep their numbers"


def _collective_that_raises():
    dist.broadcast(torch.ones(2), src=3)  # no rank 3 in a group of one: torch's own error


def test_what_a_collective_raises_is_unchanged_whether_or_not_it_is_recorded(tmp_path, capsys):
    plain, recorded = _with_and_without_recorder(_collective_that_raises, tmp_path / "failing", _without_ring_file(tmp_path))
    assert recorded == plain and plain[:2] == ("raised", "RuntimeError"), (plain, recorded)
    assert list(_failed_hooks(capsys.readouterr().err)) == ["torch.distributed wrappers"]
    recorder = CollectiveRecorder()
    plain, recorded = _with_and_without_recorder(_collective_that_raises, tmp_path / "recording", recorder)
    assert recorded == plain
    assert (recorder.ring[0].op, recorder.ring[0].state) == ("broadcast", "failed") and gradsync_warnings(capsys.readouterr().err) == []


def _a_hook_that_raises(state, bucket):
    raise ValueError("the user's hook failed")


def _backward_through_a_failing_comm_hook():
    model = DistributedDataParallel(torch.nn.Linear(3, 2))
    model.register_comm_hook(None, _a_hook_that_raises)
    model(torch.ones(4, 3)).sum().backward()


def test_what_a_users_comm_hook_raises_reaches_the_script_unchanged(tmp_path, capsys):
    plain, recorded = _with_and_without_recorder(_backward_through_a_failing_comm_hook, tmp_path / "failing", _without_ring_file(tmp_path))
    assert recorded == plain and plain[0] == "raised" and "the user's hook failed" in plain[2], (plain, recorded)
    assert "DDP gradient bucket hook" in _failed_hooks(capsys.readouterr().err)


def test_ddp_built_without_a_module_raises_pythons_own_error(tmp_path, capsys):
    plain, recorded = _with_and_without_recorder(lambda: DistributedDataParallel(), tmp_path, CollectiveRecorder())
    assert recorded == plain and plain[:2] == ("raised", "TypeError"), (plain, recorded)
    assert list(_failed_hooks(capsys.readouterr().err)) == ["DDP construction hook"]  # its record had no module to read


def _annotated_hook(state, bucket: int) -> torch.futures.Future[torch.Tensor]:  # DDP wants dist.GradBucket
    raise AssertionError("never called: DDP refuses it")


@pytest.mark.parametrize("hook", [_annotated_hook, "not callable", functools.partial(_a_hook_that_raises)],
                         ids=["wrong_annotation", "not_callable", "nameless"])
def test_ddp_accepts_or_refuses_a_comm_hook_as_without_gradsync(tmp_path, hook):
    def register():
        DistributedDataParallel(torch.nn.Linear(3, 2)).register_comm_hook(None, hook)

    plain, recorded = _with_and_without_recorder(register, tmp_path, CollectiveRecorder())
    assert recorded == plain and plain[0] == "raised", (plain, recorded)


def _training_a_model_whose_watch_broke():
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(3, 2))
    model.register_comm_hook(None, __import__("torch.distributed.algorithms.ddp_comm_hooks.default_hooks",
                                              fromlist=["allreduce_hook"]).allreduce_hook)
    model(torch.ones(4, 3)).sum().backward()
    return [p.grad.tolist() for p in model.parameters()]


def test_a_ddp_model_whose_watch_broke_trains_as_without_gradsync(tmp_path, capsys):
    # Nothing a script does reaches the forward hook's bookkeeping, which reads only the
    # recorder's watch of the model (kept beside the model, not on it): so the watch itself is broken here.
    recorder = CollectiveRecorder()
    recorder.watch_of = lambda ddp: "not a watch"
    plain, recorded = _with_and_without_recorder(_training_a_model_whose_watch_broke, tmp_path, recorder)
    assert recorded == plain and plain[0] == "returned", (plain, recorded)
    assert set(_failed_hooks(capsys.readouterr().err)) == {"DDP comm hook registration hook", "DDP forward hook"}


def _mesh_of_a_shape_given_as_an_int():
    from torch.distributed.device_mesh import init_device_mesh  # the recorder's, once installed

    init_device_mesh("cpu", 1)


def test_init_device_mesh_raises_torchs_own_error_for_a_shape_the_recorder_cannot_read(tmp_path, capsys):
    plain, recorded = _with_and_without_recorder(_mesh_of_a_shape_given_as_an_int, tmp_path, CollectiveRecorder())
    assert recorded == plain and plain[:2] == ("raised", "TypeError"), (plain, recorded)
    assert list(_failed_hooks(capsys.readouterr().err)) == ["init_device_mesh hook"]


def _leave_the_default_group():
    group = dist.new_group([0])
    dist.destroy_process_group(group)  # a subgroup: the script has not left
    dist.destroy_process_group()  # line: leave
    return dist.is_initialized()


def test_the_line_where_the_script_left_the_default_group_is_noted_and_the_destroy_runs_as_without_gradsync(tmp_path, capsys):
    recorder = CollectiveRecorder()
    plain, recorded = _with_and_without_recorder(_leave_the_default_group, tmp_path, recorder)
    assert recorded == plain == ("returned", False), (plain, recorded)
    line = next(i for i, text in enumerate(open(__file__), 1) if "# line: leave" in text)
    assert recorder.left_group["site"].endswith(f"tests/run/test_collectives.py:{line}"), recorder.left_group
    assert recorder.phase == "teardown" and gradsync_warnings(capsys.readouterr().err) == []


def test_a_failed_collectives_error_is_kept_without_the_backends_source_place():
    recorder = CollectiveRecorder()
    record = Record(0, "default", 1, "barrier", "", "", "train.py:3")
    recorder.finish(record, RuntimeError("[/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1"))
    assert (record.state, record.error) == ("failed", "RuntimeError: Connection closed by peer [127.0.0.1]:1")


def test_object_collectives_agree_on_what_they_exchange_not_on_what_each_rank_keeps():
    from gradsync.run.collectives import _SIGNATURES

    def signature(op: str, *args: Any) -> str:
        return _SIGNATURES[op][1](args, {})

    # all_gather_object exchanges one object per rank: a short output list fails on its own rank,
    # after an exchange that agreed (the red team's gather_metrics_short_list: rank_crashed, not shape_mismatch).
    assert signature("all_gather_object", [None], {"loss": 1.0}) == signature("all_gather_object", [None, None], {"loss": 1.0})
    # broadcast_object_list first exchanges one size per object: the lists' lengths must agree.
    assert signature("broadcast_object_list", [1, 2, 3], 0) != signature("broadcast_object_list", [1, 2], 0)


def test_the_wait_clock_counts_the_union_of_waits_and_the_one_under_way():
    """Injected instants: what a reading at each instant says the script had waited by then."""
    waits = WaitClock()
    waits.begin(10.0)
    assert waits.seconds(10.5) == 0.5  # under way: counted up to the reading
    waits.begin(10.5)  # a blocking collective inside a backward's final wait: the same time, once
    waits.end(11.0)
    assert waits.seconds(11.25) == 1.25
    waits.end(12.0)
    assert waits.seconds(20.0) == 2.0
    waits.end(21.0)  # an end without its begin (a wait begun before the clock was replaced) changes nothing
    assert waits.seconds(30.0) == 2.0
    # Read at any two instants, the count never grows by more than the time between them.
    waits.begin(30.0)
    readings = [(t, waits.seconds(t)) for t in (30.5, 31.0, 31.75)]
    assert all(w2 - w1 <= t2 - t1 for (t1, w1), (t2, w2) in zip(readings, readings[1:]))

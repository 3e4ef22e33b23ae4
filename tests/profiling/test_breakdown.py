"""Profile windows and step breakdowns: real 2-rank Gloo DDP traces, and a hand-built CUDA trace."""

import contextlib
import json
import math
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import record_function
from torch.utils.data import DataLoader, TensorDataset, default_collate

from gradsync.errors import ConfigError
from gradsync.rundir import RunDir
from gradsync.profiling import (
    ProfileWindow,
    analyze_trace,
    format_breakdown,
    parse_profile_steps,
    phase,
)
from tests.harness import launch
from tests.profiling.traces import cuda_step, event

PARTS = ("data_s", "forward_s", "backward_s", "exposed_comm_s", "optimizer_s", "other_s")


@pytest.mark.parametrize("text, window", [("3:5", (3, 5)), ("4:4", (4, 4)), (" 10:12 ", (10, 12))])
def test_profile_steps_parse(text, window):
    assert parse_profile_steps(text) == window


@pytest.mark.parametrize("text", ["5:3", "0:2", "a:b", "3", "", "3:", "-1:2", "1.5:2"])
def test_profile_steps_refused_with_an_example(text):
    with pytest.raises(ConfigError, match="--profile-steps 10:12"):
        parse_profile_steps(text)


def test_phase_is_a_free_no_op_unless_a_profiler_records():
    assert not isinstance(phase("forward"), record_function)
    with torch.profiler.profile():
        assert isinstance(phase("forward"), record_function)
    with pytest.raises(ConfigError, match="data, forward, backward, optimizer"):
        phase("loss")
    with pytest.raises(ConfigError, match="at least 1"):
        ProfileWindow(0, 2, Path("unused"), rank=0)


def _slow_collate(batch):
    # A loader that cannot keep up: decoding, a slow disk. Long against the scheduler's hiccups
    # on a loaded 2-core machine: at 50 ms one rank waited 35 ms for its peer's late loader
    # (exposed communication), and data was no longer twice every other part.
    time.sleep(0.15)
    return default_collate(batch)


def _training_setup(slow_data, bucket_views=False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 10),
    )
    if dist.is_initialized():
        # Small buckets, so reductions start while backward still computes the first layers.
        model = DistributedDataParallel(model, bucket_cap_mb=0.1, gradient_as_bucket_view=bucket_views)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(512, 64, generator=generator), torch.randint(0, 10, (512,), generator=generator)
    )
    loader = DataLoader(data, batch_size=32, collate_fn=_slow_collate if slow_data else None)
    return model, optimizer, loader


def _annotated_steps(window, steps, slow_data):
    model, optimizer, loader = _training_setup(slow_data)
    batches = iter(loader)
    for step in range(1, steps + 1):
        with phase("data"):
            x, y = next(batches)
        with phase("forward"):
            loss = F.cross_entropy(model(x), y)
        with phase("backward"):
            loss.backward()
        with phase("optimizer"):
            optimizer.step()
            optimizer.zero_grad()
        window.step_finished(step)


def train_in_profile_window(out_dir, slow_data):
    dist.init_process_group("gloo")
    window = ProfileWindow(*parse_profile_steps("3:5"), run_dir=Path(out_dir), rank=dist.get_rank())
    _annotated_steps(window, steps=6, slow_data=slow_data)
    # No destroy_process_group(): with the DDP model still alive it would hold the group's last
    # reference and deadlock in its destructor (see tests/comm/test_compression.py).
    return {"recording": window.recording}


def train_unannotated_under_torch_profiler(out_dir, micro_batches, bucket_views):
    """A script that knows nothing of gradsync: torch.profiler's own schedule and step()."""
    dist.init_process_group("gloo")
    model, optimizer, loader = _training_setup(slow_data=False, bucket_views=bucket_views)
    schedule = torch.profiler.schedule(wait=1, warmup=1, active=3, repeat=1)
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], schedule=schedule
    ) as profiler:
        for step, (x, y) in enumerate(loader, 1):
            optimizer.zero_grad()
            for micro_x, micro_y, last in zip(
                x.chunk(micro_batches), y.chunk(micro_batches), range(1 - micro_batches, 1)
            ):
                with contextlib.nullcontext() if last == 0 else model.no_sync():
                    F.cross_entropy(model(micro_x), micro_y).backward()
            optimizer.step()
            profiler.step()
            if step == 5:
                break
    trace = RunDir(out_dir).profile_trace(dist.get_rank())
    trace.parent.mkdir(parents=True, exist_ok=True)
    profiler.export_chrome_trace(str(trace))


def _assert_partitions(steps):
    for times in steps:
        parts = [times[name] for name in PARTS]
        assert all(part >= 0 for part in parts), times
        # The parts label disjoint pieces of the step, so they add up exactly (float rounding aside).
        assert math.isclose(sum(parts), times["step_s"], rel_tol=1e-9), times
        assert 0 <= times["hidden_comm_s"] <= times["comm_s"] + 1e-12


def test_breakdown_of_an_annotated_ddp_run(tmp_path):
    assert (
        launch(train_in_profile_window, 2, out_dir=str(tmp_path), slow_data=False)
        == [{"recording": False}] * 2
    )
    trace = json.loads(RunDir(tmp_path).profile_trace(0).read_text())
    assert trace["traceEvents"]
    breakdown = json.loads(RunDir(tmp_path).profile_breakdown(0).read_text())
    steps = breakdown["steps"]
    assert [s["step"] for s in steps] == [3, 4, 5]
    _assert_partitions(steps)
    for times in steps:
        assert min(times["data_s"], times["forward_s"], times["backward_s"], times["optimizer_s"]) > 0, times
        assert times["comm_s"] > 0 and 0 <= times["overlap_ratio"] <= 1, times
        # On Gloo each bucket's collective runs while backward computes or while the reducer
        # waits for it at the end of backward: hidden and exposed are all of it.
        assert times["hidden_comm_s"] + times["exposed_comm_s"] == pytest.approx(times["comm_s"], abs=1e-9), (
            times
        )
        # The last bucket is reduced after the last gradient is computed: some wait is left.
        assert times["exposed_comm_s"] > 0, times
    assert breakdown["annotated_phases"] == ["data", "forward", "backward", "optimizer"]
    assert breakdown["comm_source"] == "gloo"
    # The file is what analyze_trace finds in the trace, and what format_breakdown can show.
    assert analyze_trace(RunDir(tmp_path).profile_trace(0)).to_dict() == breakdown
    assert "mean" in format_breakdown(analyze_trace(trace))


def test_slow_data_loading_is_the_largest_part(tmp_path):
    launch(train_in_profile_window, 2, out_dir=str(tmp_path), slow_data=True)
    breakdown = json.loads(RunDir(tmp_path).profile_breakdown(0).read_text())
    _assert_partitions(breakdown["steps"])
    for times in breakdown["steps"]:
        assert times["data_s"] >= 0.045, times
        others = [times[name] for name in PARTS if name != "data_s"]
        assert times["data_s"] > 2 * max(others), times


@pytest.mark.parametrize(
    "micro_batches, bucket_views", [(1, False), (2, True)], ids=["plain", "accumulation_bucket_views"]
)
def test_breakdown_of_an_unannotated_ddp_script(tmp_path, micro_batches, bucket_views):
    """With gradient accumulation the step holds two backward passes, one without communication;
    with gradients as bucket views DDP copies nothing back, so its final wait has no events."""
    launch(
        train_unannotated_under_torch_profiler,
        2,
        out_dir=str(tmp_path),
        micro_batches=micro_batches,
        bucket_views=bucket_views,
    )
    breakdown = analyze_trace(RunDir(tmp_path).profile_trace(0))
    # torch counts ProfilerStep#N from 0: step 0 waits, 1 warms up, 2 to 4 are recorded.
    assert [s.step for s in breakdown.steps] == [2, 3, 4]
    assert breakdown.annotated_phases == ()
    _assert_partitions(breakdown.to_dict()["steps"])
    events = json.loads(RunDir(tmp_path).profile_trace(0).read_text())["traceEvents"]
    for times in breakdown.steps:
        assert min(times.data_s, times.forward_s, times.backward_s, times.optimizer_s) > 0, times
        assert times.comm_s > 0 and times.exposed_comm_s > 0, times
        assert times.hidden_comm_s + times.exposed_comm_s == pytest.approx(times.comm_s, abs=1e-9), times
        # Every micro-batch's DDP forward counts as forward: the passes were told apart.
        (step,) = [e for e in events if e["name"] == f"ProfilerStep#{times.step}"]
        ddp_forwards = [
            e
            for e in events
            if e["name"] == "DistributedDataParallel.forward"
            and step["ts"] <= e["ts"] <= step["ts"] + step["dur"]
        ]
        assert len(ddp_forwards) == micro_batches
        assert times.forward_s >= sum(e["dur"] for e in ddp_forwards) / 1e6, times


def test_close_writes_a_window_that_training_ended_inside_of(tmp_path):
    window = ProfileWindow(2, 10, tmp_path, rank=0)
    assert not window.recording
    _annotated_steps(window, steps=4, slow_data=False)
    assert window.recording
    window.close()
    assert not window.recording and window.breakdown is not None
    assert [s.step for s in window.breakdown.steps] == [2, 3, 4]
    written = json.loads(RunDir(tmp_path).profile_breakdown(0).read_text())
    assert written == window.breakdown.to_dict()
    # Without DDP nothing communicates: no overlap to speak of.
    assert written["comm_source"] == "none" and written["mean"]["overlap_ratio"] is None
    _assert_partitions(written["steps"])


def test_cuda_trace_counts_nccl_kernels_and_device_waits():
    """A hand-built trace in Kineto's CUDA layout (no GPU here): see traces.cuda_step."""
    breakdown = analyze_trace(cuda_step())
    (times,) = breakdown.steps
    assert breakdown.comm_source == "nccl"
    assert times.step == 7
    # comm [470, 660] overlaps backward's kernels [330, 560] for 90 µs of its 190.
    assert times.comm_s == pytest.approx(190e-6) and times.hidden_comm_s == pytest.approx(90e-6)
    assert times.overlap_ratio == pytest.approx(90 / 190)
    # Waits: backward after its last autograd function [480, 600] and the sync [620, 680]; of
    # them, NCCL alone runs on the GPU in [560, 600] and [620, 660].
    expected = {
        "data_s": 100,
        "forward_s": 200,
        "backward_s": 260,
        "exposed_comm_s": 80,
        "optimizer_s": 60,
        "other_s": 300,
    }
    assert {name: getattr(times, name) for name in PARTS} == pytest.approx(
        {k: v * 1e-6 for k, v in expected.items()}
    )
    assert "47%" in format_breakdown(breakdown)  # the overlap column


def test_a_trace_without_step_ranges_is_refused():
    with pytest.raises(ConfigError, match="ProfileWindow"):
        analyze_trace({"traceEvents": [event("aten::mm", 0, 10, 1)]})

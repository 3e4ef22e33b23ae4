"""gradsync's step breakdown next to Holistic Trace Analysis (HTA) on the same Kineto traces.

HTA is the reference for communication/computation overlap and temporal breakdown, but it
measures GPU kernels only. On a CUDA trace the overlap of the two agrees; on the CPU/Gloo traces
recorded here HTA has nothing to measure (docs/report.md, "Checked against HTA", says why each
number differs). HTA is a test dependency only."""

from __future__ import annotations

import json
import math

import pytest

from gradsync.profiling import analyze_trace
from gradsync.rundir import RunDir
from tests.harness import launch
from tests.profiling.test_breakdown import train_in_profile_window
from tests.profiling.traces import cuda_step

hta = pytest.importorskip("hta.trace_analysis", reason="HolisticTraceAnalysis is not installed (make test installs it)")

OVERLAP_TOLERANCE = 0.005  # half a percentage point: HTA rounds its percentage to two decimals


def _hta(trace_path):
    """HTA on one rank's trace (given by file: its folder also holds gradsync's breakdown JSON,
    which HTA would try to read as a trace)."""
    return hta.TraceAnalysis(trace_files={0: str(trace_path)}, trace_dir=str(trace_path.parent))


def test_on_a_cuda_trace_the_overlap_agrees_and_the_exposed_time_differs_by_what_the_cpu_did_not_wait_for(tmp_path):
    trace = tmp_path / "rank0.trace.json"
    trace.write_text(json.dumps(cuda_step()))
    ours = analyze_trace(trace).steps[0]
    theirs = _hta(trace)
    overlap = theirs.get_comm_comp_overlap(visualize=False)["comp_comm_overlap_pctg"].iloc[0] / 100
    assert overlap == pytest.approx(ours.overlap_ratio, abs=OVERLAP_TOLERANCE)
    breakdown = theirs.get_temporal_breakdown(visualize=False).iloc[0]
    # HTA's non-compute time is the NCCL kernel outside compute kernels on the GPU: [560, 660].
    assert breakdown["non_compute_time(us)"] == pytest.approx(100)
    # gradsync's exposed communication is the part of it the training thread waited for:
    # [560, 600] (after backward) and [620, 660] (in the stream sync); in [600, 620] the CPU was
    # running the optimizer while the GPU reduced, which did not lengthen the step.
    assert ours.exposed_comm_s * 1e6 == pytest.approx(80)
    assert breakdown["idle_time(us)"] == pytest.approx(40)  # the GPU between forward's and backward's kernels


def _profiled_gloo_run(tmp_path):
    launch(train_in_profile_window, 2, out_dir=str(tmp_path), slow_data=False)
    return RunDir(tmp_path).profile_trace(0)


@pytest.mark.launches
def test_on_a_cpu_gloo_trace_hta_has_no_kernels_to_measure_and_gradsync_measures_the_threads(tmp_path):
    """If an HTA release learns CPU traces, this fails: then compare its numbers here too."""
    trace = _profiled_gloo_run(tmp_path)
    ours = analyze_trace(trace)
    assert all(step.comm_s > 0 and step.overlap_ratio is not None for step in ours.steps)
    theirs = _hta(trace)
    overlap = theirs.get_comm_comp_overlap(visualize=False)["comp_comm_overlap_pctg"].iloc[0]
    assert math.isnan(overlap), "HTA's overlap is over GPU kernels; a CPU trace has none"
    with pytest.raises(IndexError):  # its temporal breakdown indexes the first GPU kernel
        theirs.get_temporal_breakdown(visualize=False)

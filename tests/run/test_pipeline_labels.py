"""A pipeline's sends and receives say what they carry: the stage, the micro-batch, activations
or gradients, and the stage at the other end. Labels are attached where torch's stages build
their operations, once the script imports the stage module, and never lent to another tensor."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gradsync.run.pipeline_labels import PipelineLabels, PipelineMessage, _StageSteps

REPO_ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
JOB = REPO_ROOT / "tests/run/pipeline_job.py"


def _message(**changes) -> PipelineMessage:
    facts = dict(stage=0, stages=2, step=3, microbatch=1, microbatches=4, schedule="ScheduleGPipe", carries="activations",
                 direction="to", peer_stage=1)
    return PipelineMessage(**(facts | changes))


def test_a_label_belongs_to_its_tensor_only():
    labels = PipelineLabels()
    message = torch.zeros(3)
    labels.label(message, _message())
    assert labels.of(message).text == "pipeline stage 0 of 2, step 3: micro-batch 1 of 4's activations to stage 1"
    assert labels.of(torch.zeros(3)) is None
    key = id(message)
    del message
    gc.collect()
    stranger = [torch.zeros(3) for _ in range(64)]  # one may take the freed id: it gets no label
    assert all(labels.of(t) is None for t in stranger) and key in labels._labels


def test_a_messages_facts_are_what_its_text_says_and_set_up_has_no_micro_batch():
    assert _message().facts() == {"stage": 0, "stages": 2, "step": 3, "microbatch": 1, "microbatches": 4,
                                  "schedule": "ScheduleGPipe", "carries": "activations", "direction": "to", "peer_stage": 1}
    setup = _message(microbatch=None, carries="setup", direction="with", peer_stage=None, microbatches=8)
    assert setup.text == "pipeline stage 0 of 2, step 3: setting up for 8 micro-batches (the shapes its neighbours send)"


def test_a_step_begins_when_micro_batch_0s_forward_is_built_again():
    class Stage:  # any object a schedule drives
        pass

    steps, middle, first = _StageSteps(), Stage(), Stage()
    assert steps.note(middle, "", -1)[0] == 1  # set-up, before the first step
    seen = [steps.note(middle, method, chunk)[0] for method, chunk in [
        ("get_fwd_recv_ops", 0), ("get_fwd_send_ops", 0), ("get_fwd_recv_ops", 1), ("get_fwd_send_ops", 1),
        ("get_bwd_recv_ops", 0), ("get_bwd_send_ops", 0),
        ("get_fwd_recv_ops", 0), ("get_fwd_send_ops", 0), ("get_bwd_recv_ops", 1),
    ]]
    assert seen == [1, 1, 1, 1, 1, 1, 2, 2, 2]
    assert steps.note(middle, "", -1)[0] == 3  # a new schedule's set-up belongs to the next step
    # A first stage never builds receives in some schedules: its sends alone count the steps.
    assert [steps.note(first, "get_fwd_send_ops", chunk)[0] for chunk in (0, 1, 0, 1, 0)] == [1, 1, 2, 2, 3]
    assert steps.note(first, "get_fwd_send_ops", 0)[1] == ""  # no schedule among the callers here


@pytest.mark.launches
def test_the_stage_class_is_wrapped_when_the_script_imports_it_and_unwrapped_after():
    # A fresh interpreter: the stage module is not imported before the watch starts, as in a script.
    code = """
import sys
from gradsync.run.pipeline_labels import PipelineLabels, STAGE_MODULE, watch_pipelining
assert STAGE_MODULE not in sys.modules
undo = watch_pipelining(PipelineLabels())
from torch.distributed.pipelining.stage import _PipelineStageBase as Base
wrapped = hasattr(Base.get_fwd_recv_ops, "__gradsync_original__") and hasattr(Base.get_bwd_send_ops, "__gradsync_original__")
undo()
print(wrapped, hasattr(Base.get_fwd_recv_ops, "__gradsync_original__"))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "False"]


def _gradsync_run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "gradsync"), "run", "--standalone", "--nproc-per-node", "2", "--stall-timeout", "10",
         "--run-dir", str(tmp_path / "run"), str(JOB), *args],
        capture_output=True, text=True, timeout=180, cwd=tmp_path,
    )


@pytest.mark.launches
def test_a_pipeline_whose_stages_disagree_is_named_by_stage_and_micro_batch(tmp_path):
    done = _gradsync_run(tmp_path, "--mismatch")
    out = done.stdout + done.stderr
    assert done.returncode != 0
    # The last stage waits for micro-batch 4's activations (the first sent 0-3); the first waits
    # for micro-batch 0's gradients, at the lines that call schedule.step.
    diagnosis = json.loads((tmp_path / "run" / "diagnosis.json").read_text())
    said = json.dumps(diagnosis)
    assert "irecv (pipeline stage 1 of 2, step 1: micro-batch 4 of 8's activations from stage 0" in said
    assert "irecv (pipeline stage 0 of 2, step 1: micro-batch 0 of 4's gradients from stage 1" in said
    assert "pipeline_microbatch_mismatch" in out
    assert diagnosis["findings"][0]["category"] == "pipeline_microbatch_mismatch"
    assert "pipeline_job.py:" in json.dumps(diagnosis)


@pytest.mark.launches
def test_a_healthy_pipeline_runs_as_under_torchrun(tmp_path):
    done = _gradsync_run(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "rank 0 done" in done.stdout and "rank 1 done" in done.stdout
    assert "ok: 2 ranks finished" in done.stdout + done.stderr

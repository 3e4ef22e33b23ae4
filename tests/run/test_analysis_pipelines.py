"""What a pipeline's stages must agree on (gradsync.run.analysis.pipelines), on hand-made rank
states: each invariant named when it breaks, in its order, and left alone when a stage is merely
a step ahead of its neighbour, or a crash elsewhere is the cause."""

from __future__ import annotations

from gradsync.run.analysis.rules import diagnose
from tests.run.test_analysis import exception, record, view

_ids = iter(range(10_000))


def message(stage, step, microbatch, carries, direction, peer, *, microbatches=4, schedule="ScheduleGPipe",
            shape="float32[2, 16]", state="finished", site="train.py:30", stages=2):
    """A pipeline send or receive as the recorder keeps it, between stage `stage` (rank = stage)
    and stage `peer`."""
    op = "irecv" if direction == "from" else "isend"
    facts = {"stage": stage, "stages": stages, "step": step, "microbatch": microbatch, "microbatches": microbatches,
             "schedule": schedule, "carries": carries, "direction": direction, "peer_stage": peer}
    if carries == "setup":  # the shapes exchanged before any micro-batch: no micro-batch, no peer stage
        facts.update(microbatch=None, direction="with", peer_stage=None)
    side = "src" if direction == "from" else "dst"
    kept = record(None, op=op, signature=f"{shape} {side}={peer}", kind=f"pipeline stage {stage}", site=site,
                  state=state, entered=float(next(_ids)))
    kept["index"] = kept["entered"]
    kept["args"] = {"pipeline": facts}
    return kept


def one_step(stage, step, *, microbatches=4, schedule="ScheduleGPipe", shape="float32[2, 16]"):
    """A whole GPipe step of a 2-stage pipeline, as stage `stage` recorded it (all finished)."""
    peer, forward, backward = (1, "to", "from") if stage == 0 else (0, "from", "to")
    kept = [message(stage, step, m, "activations", forward, peer, microbatches=microbatches, schedule=schedule, shape=shape)
            for m in range(microbatches)]
    kept += [message(stage, step, m, "gradients", backward, peer, microbatches=microbatches, schedule=schedule, shape=shape)
             for m in range(microbatches)]
    return kept


def _only_error(diagnosis):
    errors = [f for f in diagnosis["findings"] if f["severity"] == "error"]
    assert len(errors) == 1, diagnosis["findings"]
    return errors[0]


def test_stages_built_for_different_micro_batch_counts_are_named_with_both_counts():
    views = {
        0: view(0, [message(0, 1, 0, "gradients", "from", 1, state="entered")], alive=True),
        1: view(1, [message(1, 1, 4, "activations", "from", 0, microbatches=8, state="entered")], alive=True),
    }
    finding = _only_error(diagnose(views, trigger="stall", now=200.0))
    assert finding["category"] == "pipeline_microbatch_mismatch" and finding["ranks"] == [0, 1]
    assert "stage 0 (rank 0) 4, stage 1 (rank 1) 8" in finding["message"]
    assert "micro-batches 0 to 3" in finding["message"]


def test_a_micro_batch_count_mismatch_explains_the_crash_it_caused_during_set_up():
    # The last stage splits its targets 8 ways while the activations came split 4 ways: its loss
    # raised while the stages set up; the count is what was wrong, not the loss.
    views = {
        0: view(0, [message(0, 1, None, "setup", "from", 1)], exit=exception("Connection closed by peer", time=12.0), exitcode=1),
        1: view(1, [message(1, 1, None, "setup", "from", 0, microbatches=8)], exit=exception("Expected input batch_size (4) to match target batch_size (2).", "ValueError",
                                          "train.py:38", time=11.0), exitcode=1),
    }
    finding = _only_error(diagnose(views, trigger="failure", now=20.0))
    assert finding["category"] == "pipeline_microbatch_mismatch", finding
    assert "raised ValueError: Expected input batch_size (4)" in finding["message"]


def test_a_stage_that_went_on_to_an_evaluation_schedule_is_not_compared_with_one_stuck_before_it():
    # Stage 0 finished step 2's training and started step 3: an evaluation with 2 micro-batches.
    # Stage 1 never left step 2 (stuck in a barrier only it calls): not a micro-batch mismatch.
    barrier = record(7, op="barrier", signature="", site="train.py:50", state="entered", entered=9_999.0)
    barrier["index"] = 9_999.0
    views = {
        0: view(0, [*one_step(0, 2), message(0, 3, 0, "activations", "to", 1, microbatches=2,
                                             schedule="_ScheduleForwardOnly", state="entered")], alive=True),
        1: view(1, [*one_step(1, 2), barrier], alive=True),
    }
    finding = _only_error(diagnose(views, trigger="stall", now=200.0))
    assert finding["category"] not in ("pipeline_microbatch_mismatch", "pipeline_schedule_mismatch"), finding


def test_stages_running_different_schedules_are_named_with_both():
    views = {
        0: view(0, [message(0, 1, 2, "activations", "to", 1, state="entered")], alive=True),
        1: view(1, [message(1, 1, 0, "gradients", "to", 0, schedule="Schedule1F1B", state="entered")], alive=True),
    }
    finding = _only_error(diagnose(views, trigger="stall", now=200.0))
    assert finding["category"] == "pipeline_schedule_mismatch"
    assert "stage 0 (rank 0) ScheduleGPipe, stage 1 (rank 1) Schedule1F1B" in finding["message"]


def test_a_message_sent_in_another_shape_than_the_receiver_posted_names_both_shapes_and_the_step():
    views = {
        0: view(0, [*one_step(0, 1, shape="float32[2, 6, 16]"),
                    message(0, 2, 0, "activations", "to", 1, shape="float32[2, 9, 16]", state="entered")], alive=True),
        1: view(1, [*one_step(1, 1, shape="float32[2, 6, 16]"),
                    message(1, 2, 0, "activations", "from", 0, shape="float32[2, 6, 16]", state="entered")],
                exitcode=-6, signal="SIGABRT"),
    }
    finding = _only_error(diagnose(views, trigger="failure", now=200.0))
    assert finding["category"] == "pipeline_shape_mismatch" and finding["ranks"] == [0, 1]
    assert "In step 2, stage 0 (rank 0) sent micro-batch 0's activations as float32[2, 9, 16]" in finding["message"]
    assert "stage 1 (rank 1) expected float32[2, 6, 16]" in finding["message"]
    assert "first step" in finding["message"]


def test_a_sender_that_skipped_a_micro_batch_is_named_where_the_orders_part():
    # Stage 0 sent micro-batches 0, 1, 3 (it skipped 2); stage 1 took the third message for its
    # micro-batch 2 and waits for a fourth, while stage 0 waits for gradients.
    sent = [message(0, 2, m, "activations", "to", 1) for m in (0, 1, 3)]
    received = [message(1, 2, m, "activations", "from", 0) for m in (0, 1, 2)]
    views = {
        0: view(0, [*one_step(0, 1), *sent, message(0, 2, 0, "gradients", "from", 1, state="entered")], alive=True),
        1: view(1, [*one_step(1, 1), *received, message(1, 2, 3, "activations", "from", 0, state="entered")], alive=True),
    }
    finding = _only_error(diagnose(views, trigger="stall", now=200.0))
    assert finding["category"] == "pipeline_microbatch_skipped" and finding["ranks"] == [0], finding
    assert ("In step 2, stage 0 (rank 0) went past micro-batch 2's activations without sending it (stage 0 (rank 0) "
            "sent micro-batches 0, 1, 3; stage 1 (rank 1) received 0, 1, 2 and waits for 3)") in finding["message"]


def test_a_receiver_that_went_on_without_the_last_micro_batch_skipped_it():
    # GPipe: stage 1 received 0-2, skipped 3 and went on to send gradients; stage 0 waits to send 3
    # and has no gradient receive open (it posts them once its sends are done).
    views = {
        0: view(0, [*[message(0, 1, m, "activations", "to", 1) for m in range(3)],
                    message(0, 1, 3, "activations", "to", 1, state="entered")], alive=True),
        1: view(1, [*[message(1, 1, m, "activations", "from", 0) for m in range(3)],
                    message(1, 1, 0, "gradients", "to", 0, state="entered")], alive=True),
    }
    finding = _only_error(diagnose(views, trigger="stall", now=200.0))
    assert finding["category"] == "pipeline_microbatch_skipped" and finding["ranks"] == [1], finding
    assert "stage 1 (rank 1) went past micro-batch 3's activations without receiving it" in finding["message"]


def test_1f1b_neighbours_blocked_mid_exchange_have_skipped_nothing():
    # Stage 0 sends micro-batch 2's activations and receives micro-batch 1's gradients at once;
    # stage 1 sends those gradients: a network that stopped delivering, not a skipped micro-batch.
    views = {
        0: view(0, [*[message(0, 1, m, "activations", "to", 1) for m in range(2)], message(0, 1, 0, "gradients", "from", 1),
                    message(0, 1, 2, "activations", "to", 1, schedule="Schedule1F1B", state="entered"),
                    message(0, 1, 1, "gradients", "from", 1, schedule="Schedule1F1B", state="entered")], alive=True),
        1: view(1, [*[message(1, 1, m, "activations", "from", 0) for m in range(2)], message(1, 1, 0, "gradients", "to", 0),
                    message(1, 1, 1, "gradients", "to", 0, schedule="Schedule1F1B", state="entered")], alive=True),
    }
    for v in views.values():  # one schedule throughout
        for r in v.records:
            r["args"]["pipeline"]["schedule"] = "Schedule1F1B"
    finding = _only_error(diagnose(views, trigger="stall", now=200.0))
    assert not finding["category"].startswith("pipeline_"), finding


def test_a_stage_that_finished_with_fewer_steps_skipped_a_batch():
    views = {
        0: view(0, [*one_step(0, 4), message(0, 5, 1, "activations", "to", 1, state="entered")], alive=True),
        1: view(1, one_step(1, 4), exit={"status": "finished", "time": 150.0}, exitcode=0),
    }
    finding = _only_error(diagnose(views, trigger="stall", now=200.0))
    assert finding["category"] == "pipeline_steps_differ" and finding["ranks"] == [1]
    assert "stage 1 (rank 1) ran 4 steps of its schedule and finished the script, while stage 0 (rank 0) is in step 5" in finding["message"]


def test_a_stage_that_left_the_pipeline_for_another_collective_after_fewer_steps_skipped_a_batch():
    barrier = record(7, op="barrier", signature="", site="train.py:50", state="entered", entered=9_999.0)
    barrier["index"] = 9_999.0
    views = {
        0: view(0, [*one_step(0, 4), message(0, 5, 1, "activations", "to", 1, state="entered")], alive=True),
        1: view(1, [*one_step(1, 4), barrier], alive=True),
    }
    finding = _only_error(diagnose(views, trigger="stall", now=200.0))
    assert finding["category"] == "pipeline_steps_differ" and finding["ranks"] == [1]
    assert "left the pipeline after 4 steps and waits in barrier" in finding["message"]


def test_stages_a_step_apart_around_a_crash_are_not_called_a_skipped_batch():
    # Three stages. The first starts step 3 once step 2's gradients are back from the middle one,
    # which still waits for its own from the last; the last stage raised. The crash is the cause.
    views = {
        0: view(0, [message(0, 3, 0, "activations", "to", 1, stages=3, state="entered")], alive=True),
        1: view(1, [message(1, 2, 3, "gradients", "from", 2, stages=3, state="entered")], alive=True),
        2: view(2, [message(2, 2, 2, "gradients", "to", 1, stages=3)],
                exit=exception("CUDA error: an illegal memory access", "RuntimeError", "opt.py:9", time=11.0), exitcode=1),
    }
    finding = _only_error(diagnose(views, trigger="failure", now=20.0))
    assert finding["category"] == "rank_crashed" and finding["ranks"] == [2]


def test_stages_that_agree_and_wait_together_are_left_to_the_other_questions():
    # A matched send/recv pair blocked together: the network, not the pipeline.
    views = {
        0: view(0, [*one_step(0, 1), message(0, 2, 0, "activations", "to", 1, state="entered")], alive=True),
        1: view(1, [*one_step(1, 1), message(1, 2, 0, "activations", "from", 0, state="entered")], alive=True),
    }
    finding = _only_error(diagnose(views, trigger="stall", now=200.0))
    assert not finding["category"].startswith("pipeline_"), finding


def test_a_healthy_pipeline_that_ended_has_no_finding():
    views = {rank: view(rank, one_step(rank, 1) + one_step(rank, 2), exit={"status": "finished", "time": 150.0}, exitcode=0)
             for rank in (0, 1)}
    assert diagnose(views, trigger="exit", now=200.0)["findings"] == []

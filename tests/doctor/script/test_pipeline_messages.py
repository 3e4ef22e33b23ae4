"""pipeline_messages on hand-made facts: a link whose sender and receivers saw other tensors is an
error naming both; stages built for other micro-batch counts or schedules are another; replicas of
a stage count alike, and a healthy pipeline (schedules changed on every stage at once) is silent."""

from __future__ import annotations

from tests.doctor.script.facts import categories, findings, script_facts


def link(stage, peer, carries, direction, tensors, microbatches=(4,), schedules=("ScheduleGPipe",)):
    return {"stage": stage, "peer_stage": peer, "carries": carries, "direction": direction, "tensors": list(tensors),
            "microbatches": list(microbatches), "schedules": list(schedules), "site": f"train.py:{30 + stage}"}


def stage_links(stage, sent="float32[2, 16]", received="float32[2, 16]", **built):
    """A 2-stage pipeline's links as stage `stage` saw them: activations forward, gradients back."""
    if stage == 0:
        return [link(0, 1, "activations", "to", [sent], **built), link(0, 1, "gradients", "from", [received], **built)]
    return [link(1, 0, "activations", "from", [received], **built), link(1, 0, "gradients", "to", [sent], **built)]


def ranks(*links_by_rank):
    return {rank: script_facts(pipeline_messages={"links": links}) for rank, links in enumerate(links_by_rank)}


def test_a_healthy_pipeline_is_silent_with_replicas_and_a_schedule_changed_everywhere():
    built = dict(microbatches=(4, 2), schedules=("Schedule1F1B", "ScheduleGPipe"))
    assert categories(ranks(stage_links(0, **built), stage_links(1, **built), stage_links(0, **built), stage_links(1, **built))) == []


def test_activations_sent_as_one_dtype_and_received_as_another_are_named_with_both():
    (finding,) = findings(ranks(stage_links(0, sent="float16[2, 16]", received="float16[2, 16]"),
                                stage_links(1, sent="float16[2, 16]", received="bfloat16[2, 16]")))
    assert finding.category == "pipeline_messages_differ" and finding.ranks == [0, 1]
    assert finding.message.startswith("Stage 0 (rank 0) sent its activations as float16[2, 16], and stage 1 (rank 1) "
                                      "received them into bfloat16[2, 16]. ")


def test_both_directions_of_one_link_are_one_finding():
    (finding,) = findings(ranks(stage_links(0, sent="bfloat16[2, 16]", received="bfloat16[2, 16]"),
                                stage_links(1, sent="float16[2, 16]", received="float16[2, 16]")))
    assert "Stage 0 (rank 0) sent its activations as bfloat16[2, 16], and stage 1 (rank 1) received them into " \
           "float16[2, 16]; stage 1 (rank 1) sent its gradients as float16[2, 16], and stage 0 (rank 0) received them " \
           "into bfloat16[2, 16]. " in finding.message
    assert finding.locations == {"0": "train.py:30", "1": "train.py:31"}


def test_one_replica_of_a_stage_that_receives_otherwise_is_named_with_the_others_of_its_link():
    (finding,) = findings(ranks(stage_links(0), stage_links(1), stage_links(0), stage_links(1, received="float32[16, 2]")))
    assert finding.category == "pipeline_messages_differ" and finding.ranks == [0, 1, 2, 3]
    assert finding.details == {"activations_sent": ["float32[2, 16]"], "activations_received": ["float32[16, 2]", "float32[2, 16]"]}


def test_stages_built_for_other_micro_batch_counts_are_named_rank_by_rank():
    (finding,) = findings(ranks(stage_links(0), stage_links(1, microbatches=(8,))))
    assert finding.category == "pipeline_stages_disagree"
    assert "rank 0: 4 micro-batches, ScheduleGPipe; rank 1: 8 micro-batches, ScheduleGPipe" in finding.message


def test_ranks_without_pipelines_say_nothing():
    assert categories(ranks([], [])) == []
    assert categories({0: script_facts(), 1: script_facts()}) == []  # facts of an older gradsync

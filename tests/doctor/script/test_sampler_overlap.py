"""sampler_overlap on hand-made facts: overlapping shares are found; padding, strided shards,
evaluation loaders and tensor-parallel ranks sharing a share are not."""

from __future__ import annotations

from tests.doctor.script.facts import (
    TRAIN_LOADER,
    consistency_categories,
    consistency_facts,
    consistency_found,
    draw,
    drawing,
)


def test_overlapping_shares_are_found_and_padding_is_allowed():
    assert consistency_categories(drawing(draw([0, 2, 4, 6]), draw([1, 3, 5, 7], sampler_rank=1))) == []
    # DistributedSampler pads 7 samples to 8 by repeating one.
    padded = drawing(draw([0, 2, 4, 6], dataset_size=7), draw([1, 3, 5, 0], sampler_rank=1, dataset_size=7))
    assert consistency_categories(padded) == []
    (finding,) = consistency_found(drawing(draw([0, 2, 4, 6]), draw([0, 2, 5, 7], seed=1, sampler_rank=1)))
    assert finding.category == "sampler_overlap" and finding.details["drawn_twice"] == 2 and finding.details["never_drawn"] == 2
    assert "seeds differ (rank 0: seed=0, rank 1: seed=1)" in finding.message
    assert finding.locations == {"0": "train.py:25", "1": "train.py:25"}  # the sampler's construction


def test_ranks_drawing_from_the_whole_dataset_without_a_sampler_overlap_even_in_a_partial_pass():
    whole = drawing(draw([5, 1, 7], distributed=False, complete=False), draw([1, 6, 2], distributed=False, complete=False))
    (finding,) = consistency_found(whole)
    assert finding.details["drawn_twice"] == 1 and not finding.details["complete"]
    assert "no rank uses a DistributedSampler" in finding.message and finding.locations["0"] == "train.py:30"
    # A hand-made strided shard (dataset[rank::world]) is a partition: nothing to say.
    strided = drawing(draw([0, 2, 4, 6], distributed=False), draw([1, 3, 5, 7], distributed=False))
    assert consistency_categories(strided) == []
    # An evaluation loader every rank reads whole is not a training share.
    evaluation = {r: consistency_facts(loader_draws=[draw(range(8), distributed=False)],
                                       loaders=[{**TRAIN_LOADER, "feeds_training": False}])
                  for r in (0, 1)}
    assert consistency_categories(evaluation) == []


def test_tensor_parallel_ranks_sharing_a_data_parallel_share_are_not_an_overlap():
    # 4 ranks, 2 data-parallel shares (num_replicas=2): ranks 0-1 draw share 0 together, 2-3 share 1.
    assert consistency_categories(drawing(draw([0, 2, 4, 6]), draw([0, 2, 4, 6]), draw([1, 3, 5, 7], sampler_rank=1),
                                          draw([1, 3, 5, 7], sampler_rank=1))) == []
    # Every sampler told it is rank 0 of 2 on four ranks, two of them with another seed: overlaps and gaps.
    wrong = drawing(draw([0, 2, 4, 6]), draw([0, 2, 4, 6]), draw([0, 3, 4, 7]), draw([0, 3, 4, 7]))
    (finding,) = consistency_found(wrong)
    assert finding.details["never_drawn"] == 2 and "rank/num_replicas do not match" in finding.message


def _with_ddp(facts: dict[int, dict], group: list[int]) -> dict[int, dict]:
    """The ranks' facts with a DDP model spanning `group`: its replicas, which the samplers must split."""
    return {rank: {**f, "models": [{"group": group}]} for rank, f in facts.items()}


def test_a_sampler_every_replica_calls_rank_0_is_named_at_its_construction_before_its_identical_batches():
    same = _with_ddp(drawing(draw([0, 2, 4, 6]), draw([0, 2, 4, 6])), [0, 1])
    (finding,) = consistency_found(same)
    # Rank 1 took rank 0's place: rank 0 stands where it should.
    assert (finding.category, finding.ranks, finding.locations) == ("sampler_position_wrong", [1], {"1": "train.py:25"})
    assert "rank 0: rank=0, num_replicas=2; rank 1: rank=0, num_replicas=2" in finding.message


def test_a_sampler_told_another_number_of_replicas_is_named():
    four = [{**draw([0, 4], sampler_rank=r), "sampler": {**draw([0, 4], sampler_rank=r)["sampler"], "num_replicas": 4}}
            for r in (0, 1)]
    (finding,) = consistency_found(_with_ddp(drawing(*four), [0, 1]))
    assert finding.category == "sampler_position_wrong" and "splits the data 4 ways among 2 ranks" in finding.message


def test_samplers_at_the_groups_positions_are_left_alone():
    split = _with_ddp(drawing(draw([0, 2, 4, 6]), draw([1, 3, 5, 7], sampler_rank=1)), [0, 1])
    assert consistency_categories(split) == []

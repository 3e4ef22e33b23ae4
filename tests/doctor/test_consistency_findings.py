"""The consistency rules on hand-made facts: each one speaks for its mistake, names the rank at
fault and the line, and stays silent on the healthy near-miss (the real runs: tests/run/test_doctor_script.py)."""

from __future__ import annotations

from gradsync.doctor.consistency_findings import consistency_findings
from gradsync.doctor.script_findings import script_check_findings


def _facts(**overrides) -> dict:
    facts = {
        "steps": 4, "syncs_per_step": [1, 1, 1, 1], "forwards": [], "models": [], "loaders": [], "sampler_passes": [],
        "host": "node0", "seeds": [], "splits": [], "loader_draws": [], "worker_copies": [], "steps_taken": [],
        "loss_walks": [], "backwards_per_step": [1, 1, 1, 1], "writes": [],
    }
    return {**facts, **overrides}


def _categories(checks: dict[int, dict]) -> list[str]:
    return [f.category for f in consistency_findings(checks)]


def _forward(before: int, after: int, evals=(), eval_site=None) -> dict:
    return {"site": "train.py:30", "rng_before": {"torch": before}, "rng_after": {"torch": after},
            "eval_modules": list(evals), "eval_count": len(evals), "eval_site": eval_site}


def _seed(after_ddp: bool, site: str = "train.py:20", forwards_before: int = 0) -> dict:
    return {"generator": "torch", "site": site, "after_ddp": after_ddp, "forwards_before": forwards_before, "value": "0"}


# -- randomness ---------------------------------------------------------------------------------


def test_identical_draws_are_blamed_on_a_seeding_after_ddp():
    same = [_forward(1, 2), _forward(2, 3)]
    checks = {r: _facts(forwards=same, seeds=[_seed(False, "train.py:10"), _seed(True)]) for r in (0, 1)}
    (finding,) = consistency_findings(checks)
    assert finding.category == "shared_random_draws" and finding.locations == {"0": "train.py:20", "1": "train.py:20"}
    # Seeded alike only before the model was built: DDP's usual start, left alone.
    assert _categories({r: _facts(forwards=same, seeds=[_seed(False)]) for r in (0, 1)}) == []
    # Per-rank seeds after DDP: the states differ.
    per_rank = {r: _facts(forwards=[_forward(10 * r + 1, 10 * r + 2)], seeds=[_seed(True)]) for r in (0, 1)}
    assert _categories(per_rank) == []
    # Seeded alike only from the 3rd forward on (an epoch loop reseeding with the epoch): judged from there.
    later = {r: _facts(forwards=[_forward(10 * r + 1, 10 * r + 2), _forward(10 * r + 2, 10 * r + 3), _forward(5, 6),
                                 _forward(7, 8)], seeds=[_seed(True, forwards_before=2)]) for r in (0, 1)}
    (finding,) = consistency_findings(later)
    assert finding.details["draws_compared"] == 3  # two forwards and the draw between them
    # No draws at all (no dropout): nothing was shared.
    assert _categories({r: _facts(forwards=[_forward(1, 1)], seeds=[_seed(True)]) for r in (0, 1)}) == []


def test_a_dataset_generator_copied_into_workers_is_a_warning_unless_a_worker_init_fn_reseeds_it():
    copy = {"loader": "train.py:40#0", "site": "train.py:40", "workers": 2, "worker_init_fn": False,
            "generators": {"rng": 7}}
    (finding,) = consistency_findings({r: _facts(worker_copies=[copy]) for r in (0, 1)})
    assert finding.category == "dataset_generator_copied" and finding.ranks == [0, 1]
    reseeded = {**copy, "worker_init_fn": True}
    assert _categories({r: _facts(worker_copies=[reseeded]) for r in (0, 1)}) == []


# -- data coverage ------------------------------------------------------------------------------


TRAIN_LOADER = {"key": "train.py:30#0", "site": "train.py:30", "feeds_training": True}


def _draw(indices, seed=0, sampler_rank=0, dataset_size=8, total_size=8, distributed=True, complete=True) -> dict:
    sampler = {"site": "train.py:25", "epoch": 0, "seed": seed, "rank": sampler_rank, "num_replicas": 2,
               "total_size": total_size} if distributed else None
    return {"loader": "train.py:30#0", "site": "train.py:30", "pass": 1, "dataset_size": dataset_size,
            "over_subset": False, "complete": complete, "indices": list(indices), "sampler": sampler}


def _drawing(*draws) -> dict[int, dict]:
    return {rank: _facts(loader_draws=[draw], loaders=[TRAIN_LOADER]) for rank, draw in enumerate(draws)}


def test_overlapping_shares_are_found_and_padding_is_allowed():
    assert _categories(_drawing(_draw([0, 2, 4, 6]), _draw([1, 3, 5, 7], sampler_rank=1))) == []
    # DistributedSampler pads 7 samples to 8 by repeating one.
    assert _categories(_drawing(_draw([0, 2, 4, 6], dataset_size=7), _draw([1, 3, 5, 0], sampler_rank=1, dataset_size=7))) == []
    (finding,) = consistency_findings(_drawing(_draw([0, 2, 4, 6]), _draw([0, 2, 5, 7], seed=1, sampler_rank=1)))
    assert finding.category == "sampler_overlap" and finding.details["drawn_twice"] == 2 and finding.details["never_drawn"] == 2
    assert "seeds differ (rank 0: seed=0, rank 1: seed=1)" in finding.message
    assert finding.locations == {"0": "train.py:25", "1": "train.py:25"}  # the sampler's construction


def test_ranks_drawing_from_the_whole_dataset_without_a_sampler_overlap_even_in_a_partial_pass():
    whole = _drawing(_draw([5, 1, 7], distributed=False, complete=False), _draw([1, 6, 2], distributed=False, complete=False))
    (finding,) = consistency_findings(whole)
    assert finding.details["drawn_twice"] == 1 and not finding.details["complete"]
    assert "no rank uses a DistributedSampler" in finding.message and finding.locations["0"] == "train.py:30"
    # A hand-made strided shard (dataset[rank::world]) is a partition: nothing to say.
    strided = _drawing(_draw([0, 2, 4, 6], distributed=False), _draw([1, 3, 5, 7], distributed=False))
    assert _categories(strided) == []
    # An evaluation loader every rank reads whole is not a training share.
    evaluation = {r: _facts(loader_draws=[_draw(range(8), distributed=False)], loaders=[{**TRAIN_LOADER, "feeds_training": False}])
                  for r in (0, 1)}
    assert _categories(evaluation) == []


def test_tensor_parallel_ranks_sharing_a_data_parallel_share_are_not_an_overlap():
    # 4 ranks, 2 data-parallel shares (num_replicas=2): ranks 0-1 draw share 0 together, 2-3 share 1.
    assert _categories(_drawing(_draw([0, 2, 4, 6]), _draw([0, 2, 4, 6]), _draw([1, 3, 5, 7], sampler_rank=1),
                                _draw([1, 3, 5, 7], sampler_rank=1))) == []
    # Every sampler told it is rank 0 of 2 on four ranks, two of them with another seed: overlaps and gaps.
    wrong = _drawing(_draw([0, 2, 4, 6]), _draw([0, 2, 4, 6]), _draw([0, 3, 4, 7]), _draw([0, 3, 4, 7]))
    (finding,) = consistency_findings(wrong)
    assert finding.details["never_drawn"] == 2 and "rank/num_replicas do not match" in finding.message


def _split(crcs, indices) -> dict:
    return {"site": "train.py:15", "generator_given": False, "lengths": [len(i) for i in indices], "crcs": crcs,
            "indices": indices}


def test_a_split_that_differs_across_ranks_is_an_error_and_explains_the_overlap():
    checks = {0: _facts(splits=[_split([1, 2], [[0, 1, 2], [3]])]), 1: _facts(splits=[_split([3, 4], [[1, 2, 3], [0]])])}
    (finding,) = consistency_findings(checks)
    assert finding.category == "data_split_differs" and finding.locations == {"0": "train.py:15", "1": "train.py:15"}
    assert "1 of rank 0's 3 samples in the first split are in rank 1's second one" in finding.message
    assert _categories({r: _facts(splits=[_split([1, 2], [[0, 1, 2], [3]])]) for r in (0, 1)}) == []


# -- gradient scale -----------------------------------------------------------------------------


def _walk(scale: float) -> dict:
    return {"site": "train.py:33", "step": 1, "scale": scale, "reduction": "sum", "elements": 16, "factor": scale / 16}


def test_a_loss_divided_by_the_world_size_is_found_unless_accumulation_explains_the_factor():
    assert _categories({r: _facts(loss_walks=[_walk(0.5)]) for r in (0, 1)}) == ["loss_scaled_by_world_size"]
    assert _categories({r: _facts(loss_walks=[_walk(1.0)]) for r in (0, 1)}) == []
    # Two micro-steps on two ranks: 1/2 is the accumulation's own factor; nothing can be said.
    assert _categories({r: _facts(loss_walks=[_walk(0.5)], backwards_per_step=[2, 2]) for r in (0, 1)}) == []
    # Four ranks, two micro-steps, 1/8: divided by both.
    four = {r: _facts(loss_walks=[_walk(0.125)], backwards_per_step=[2, 2]) for r in range(4)}
    assert _categories(four) == ["loss_scaled_by_world_size"]
    assert _categories({r: _facts(loss_walks=[_walk(0.5)], backwards_per_step=[2, 2]) for r in range(4)}) == []  # 1/accumulation


# -- mode, order, update ------------------------------------------------------------------------


def test_a_rank_training_in_eval_mode_is_named_with_the_line_that_set_it():
    trained = [_forward(1, 2), _forward(2, 3)]
    evaluated = [_forward(1, 2), _forward(2, 3, evals=["(the model)", "0", "1"], eval_site="train.py:50")]
    (finding,) = consistency_findings({0: _facts(forwards=evaluated), 1: _facts(forwards=trained)})
    assert (finding.category, finding.ranks, finding.locations) == ("eval_mode_differs", [0], {"0": "train.py:50"})
    assert "From training forward 2 on" in finding.message
    frozen = [_forward(1, 2, evals=["backbone"], eval_site="train.py:12")]  # frozen on every rank: a choice
    assert _categories({r: _facts(forwards=frozen) for r in (0, 1)}) == []


def test_a_rank_that_switched_the_ddp_wrapper_to_eval_is_found_at_its_steps():
    # ddp.eval() on rank 0: its later forwards are not training forwards, but it keeps stepping.
    def stepping(modes):
        return [{**_step(s), "modes": [m]} for s, m in enumerate(modes, 1)]

    training = {"eval_modules": [], "eval_count": 0, "eval_site": None}
    wrapper = {"eval_modules": ["(the DDP wrapper)", "(the model)", "0"], "eval_count": 3, "eval_site": "train.py:51"}
    checks = {0: _facts(steps_taken=stepping([training, wrapper, wrapper])), 1: _facts(steps_taken=stepping([training] * 3))}
    (finding,) = consistency_findings(checks)
    assert (finding.category, finding.ranks, finding.locations) == ("eval_mode_differs", [0], {"0": "train.py:51"})
    assert finding.details["step"] == 2 and "From optimizer step 2 on" in finding.message


def _model(order) -> dict:
    return {"site": "train.py:22", "parameter_order": list(order), "parameters": {}, "buffers": {}, "buffers_synced": True,
            "find_unused_parameters": False, "usage_checked_passes": 0, "incomplete_passes": 0}


def test_a_parameter_order_that_differs_is_an_error_and_replaces_the_divergence_it_causes():
    checks = {0: _facts(models=[_model(["a.weight", "b.weight"])]), 1: _facts(models=[_model(["b.weight", "a.weight"])])}
    checks[0]["models"][0]["parameters"] = {"a.weight": 1, "b.weight": 2}
    checks[1]["models"][0]["parameters"] = {"a.weight": 2, "b.weight": 1}
    (finding,) = script_check_findings(checks)
    assert finding.category == "parameter_order_differs"
    assert finding.details == {"position": 0, "names": {"0": "a.weight", "1": "b.weight"}}
    assert _categories({r: _facts(models=[_model(["a.weight", "b.weight"])]) for r in (0, 1)}) == []


def _step(step: int, grads: int = 1, hyper: str = "lr=0.1", calls=(), before: int = 10, after: int = 11) -> dict:
    return {"step": step, "optimizer": 0, "site": "train.py:40", "hyperparameters": hyper, "grads": grads,
            "params_before": before, "params_after": after, "calls": list(calls)}


CLIP = {"what": "clip_grad_norm_", "site": "train.py:38"}


def test_gradients_changed_on_one_rank_are_blamed_on_its_extra_call():
    checks = {0: _facts(steps_taken=[_step(1), _step(2, grads=5, calls=[CLIP])]), 1: _facts(steps_taken=[_step(1), _step(2)])}
    (finding,) = consistency_findings(checks)
    assert (finding.category, finding.ranks, finding.step) == ("update_differs", [0], 2)
    assert finding.locations == {"0": "train.py:38"} and "called clip_grad_norm_ at train.py:38" in finding.message
    # Clipping on every rank keeps the update the same everywhere.
    same = [_step(1, calls=[CLIP]), _step(2, calls=[CLIP])]
    assert _categories({r: _facts(steps_taken=same) for r in (0, 1)}) == []
    # A step after a backward under no_sync (local SGD, the micro-steps' own step): gradients differ by design.
    local = {0: _facts(steps_taken=[_step(1, grads=1)], syncs_per_step=[0]), 1: _facts(steps_taken=[_step(1, grads=2)], syncs_per_step=[0])}
    assert _categories(local) == []


def test_a_learning_rate_changed_on_one_rank_is_blamed_on_the_scheduler_call():
    sched = {"what": "scheduler.step", "site": "train.py:45"}
    rank0 = [_step(1), _step(2, calls=[sched]), _step(3, hyper="lr=0.05", calls=[sched])]
    rank1 = [_step(1), _step(2), _step(3)]
    (finding,) = consistency_findings({0: _facts(steps_taken=rank0), 1: _facts(steps_taken=rank1)})
    assert (finding.ranks, finding.step, finding.locations) == ([0], 3, {"0": "train.py:45"})
    assert finding.details["differs"] == "hyperparameters"
    assert "(lr: rank 0 0.05, rank 1 0.1)" in finding.message, finding.message


def test_parameters_moved_between_steps_on_one_rank_are_blamed_on_it():
    rank0 = [_step(1, before=1, after=2), _step(2, before=2, after=3)]
    rank1 = [_step(1, before=1, after=2), _step(2, before=9, after=10)]
    (finding,) = consistency_findings({0: _facts(steps_taken=rank0), 1: _facts(steps_taken=rank1)})
    assert (finding.ranks, finding.details["differs"]) == ([1], "parameters")
    assert "after optimizer step 1 (at train.py:40) and before step 2" in finding.message
    # Every rank changing them alike (weight clamping on every rank): the replicas stay equal.
    alike = [_step(1, before=1, after=2), _step(2, before=5, after=6)]
    assert _categories({r: _facts(steps_taken=alike) for r in (0, 1)}) == []


# -- files --------------------------------------------------------------------------------------


def _write(path: str, how: str = "torch.save", step: int = 3) -> dict:
    return {"path": path, "how": how, "step": step, "site": "train.py:60"}


def test_the_same_path_written_by_several_ranks_of_one_host():
    (finding,) = consistency_findings({r: _facts(writes=[_write("/ckpt/model.pt")]) for r in (0, 1)})
    assert (finding.category, finding.severity, finding.ranks) == ("same_file_written", "error", [0, 1])
    assert "at the same step" in finding.message
    own = {r: _facts(writes=[_write(f"/ckpt/rank{r}.pt")]) for r in (0, 1)}
    assert _categories(own) == []
    logs = {r: _facts(writes=[_write("/logs/train.log", how="open")]) for r in (0, 1)}
    assert [f.severity for f in consistency_findings(logs)] == ["warning"]
    hosts = {r: _facts(host=f"node{r}", writes=[_write("/local/model.pt")]) for r in (0, 1)}
    assert _categories(hosts) == []  # each host's own disk
